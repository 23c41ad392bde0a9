"""The replica flags of `pagedserve serve` (no Ray cluster needed), and that a server started
without them never imports Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from api.cli import build_parser
from api.replicas.options import (
    DEFAULT_DOWNSCALE_DELAY_S,
    DEFAULT_UPSCALE_DELAY_S,
    ReplicaOptions,
    replica_options,
)

ROOT = Path(__file__).resolve().parents[2]


def parse(*flags: str) -> ReplicaOptions | None:
    return replica_options(build_parser().parse_args(["serve", *flags]))


def test_no_replica_flag_means_one_process() -> None:
    assert parse() is None
    assert parse("--port", "9000") is None


def test_fixed_replicas_and_routing() -> None:
    opts = parse("--num-replicas", "3", "--routing", "round-robin")
    assert opts == ReplicaOptions(num_replicas=3, routing="round-robin")
    assert opts.scaling() == {"num_replicas": 3} and opts.most_replicas == 3
    assert parse("--num-replicas", "2").routing == "prefix-aware"  # type: ignore[union-attr]


def test_autoscaling_flags_become_rays_autoscaling_config() -> None:
    opts = parse("--min-replicas", "1", "--max-replicas", "4", "--target-ongoing-requests", "3",
                 "--upscale-delay", "2", "--downscale-delay", "5")
    assert opts is not None and opts.autoscaling and opts.most_replicas == 4
    cfg = opts.scaling()["autoscaling_config"]
    assert (cfg["min_replicas"], cfg["initial_replicas"], cfg["max_replicas"]) == (1, 1, 4)
    assert (cfg["target_ongoing_requests"], cfg["upscale_delay_s"],
            cfg["downscale_delay_s"]) == (3.0, 2.0, 5.0)
    defaults = parse("--min-replicas", "1", "--max-replicas", "2")
    assert defaults is not None
    assert defaults.upscale_delay_s == DEFAULT_UPSCALE_DELAY_S
    assert defaults.downscale_delay_s == DEFAULT_DOWNSCALE_DELAY_S


@pytest.mark.parametrize(("flags", "message"), [
    (("--num-replicas", "2", "--max-replicas", "3"), "not both"),
    (("--min-replicas", "2",), "both --min-replicas and --max-replicas"),
    (("--min-replicas", "3", "--max-replicas", "2"), "<="),
    (("--routing", "round-robin"), "need --num-replicas"),
    (("--ray-address", "1.2.3.4:6379"), "need --num-replicas"),
])
def test_flags_that_do_not_fit_together(flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(*flags)


def test_cli_refuses_bad_values_before_starting_anything(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    from api.cli import main
    for flags in (["--num-replicas", "0"], ["--routing", "random"],
                  ["--min-replicas", "2", "--max-replicas", "1"]):
        with pytest.raises(SystemExit) as e:
            main(["serve", *flags])
        assert e.value.code == 2
    assert "--max-replicas" in capsys.readouterr().err


SCRIPT = """
import sys
from api.cli import build_parser, replica_options
import api.app, api.routes, api.metrics
assert replica_options(build_parser().parse_args(["serve"])) is None
print("ray" in sys.modules)
"""


def test_single_process_server_never_imports_ray() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout.split()
    assert out == ["False"]


def test_rayservice_builder_reads_the_serve_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/rayservice.yaml's import_path builds the app from $PAGEDSERVE_ARGS (no cluster
    is needed to build it: the board and the GPU count are stubbed)."""
    from ray import serve

    from api.replicas import rayservice

    boards: list[str | None] = []

    def fake_board(detached_name: str | None = None) -> str:
        boards.append(detached_name)
        return "board"

    monkeypatch.setattr(rayservice, "create_board", fake_board)
    monkeypatch.setattr(rayservice, "gpus_per_replica", lambda config: 0.0)
    monkeypatch.setenv("PAGEDSERVE_ARGS", "--config tiny --min-replicas 1 --max-replicas 3 "
                       "--routing round-robin --api-key k")
    app = rayservice.app_from_env({})
    assert isinstance(app, serve.Application)
    assert boards == ["pagedserve-board"]  # detached: the builder's task ends, the app stays
    monkeypatch.setenv("PAGEDSERVE_ARGS", "--num-replicas 0")
    with pytest.raises(SystemExit):
        rayservice.app_from_env({})
