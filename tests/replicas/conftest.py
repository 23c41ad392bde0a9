"""One local Ray cluster for the Ray tests of a module (starting one costs tens of seconds on
2 cores), and the tiny model they serve."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from scheduler.config import SchedulerConfig
from tests.support.models import build_checkpoint
from tests.support.ray_serve import RayCluster, ray_cluster, ray_processes


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-llama-ray"), "llama")


def replica_config(model: Path, **scheduler: object) -> EngineConfig:
    """A replica of the tiny model: 1 torch thread; a pool that holds 8 prefixes of 400
    tokens (the affinity test); a queue bound of 2 (the 429 test)."""
    opts: dict[str, object] = {"max_num_seqs": 8, "max_num_batched_tokens": 512,
                               "max_model_len": 512, "block_size": 16,
                               "max_num_queued_reqs": 2, "enable_prefix_caching": True}
    opts.update(scheduler)
    return EngineConfig(model=str(model), dtype="float32", device="cpu", num_kv_blocks=400,
                        num_threads=1, served_model_name="tiny", enforce_eager=True,
                        scheduler=SchedulerConfig(**opts))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with ray_cluster() as c:
        yield c
    deadline = time.monotonic() + 30  # this process started the cluster: it is the driver
    while ray_processes(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_processes(os.getpid()), "Ray processes left behind"
