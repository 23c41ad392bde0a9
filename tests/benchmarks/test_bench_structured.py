"""The structured-output benchmark's driver on a tiny model: each phase keeps the asked mix of
streams, and only steps that decode every stream are timed."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_structured import Driver
from tests.support.models import loaded_runner, tiny_config
from tests.support.structured import make_engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.models import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tiny-bench"), "llama")


def test_phases_keep_the_mix_and_time_pure_decode_steps(tiny: Path) -> None:
    engine = make_engine(loaded_runner(tiny_config(tiny)), max_num_seqs=8)
    d = Driver(engine, streams=8)
    mixed = d.phase(4, 3)
    assert len(mixed) == 3 and all(t > 0 for t in mixed)
    assert sum(d.kinds.values()) == 4 and len(d.kinds) == 8
    assert d.fill_s  # the constrained rows' bitmask was filled (and timed)
    assert {s.seq_id for s in engine.scheduler.running} == set(d.kinds)
    free = d.phase(0, 2)
    assert len(free) == 2 and not any(d.kinds.values()) and len(d.kinds) == 8
