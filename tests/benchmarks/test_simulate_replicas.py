"""The replica simulation: deterministic, conserving, routing that matters, and its cost model."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest

from benchmarks import simulate_replicas
from benchmarks.profile_step_cost import build_step, grid
from benchmarks.sim_core import SimConfig, Simulation, simulate
from benchmarks.sim_replica import SimReplica
from benchmarks.sim_router import PrefixAware, make_router
from benchmarks.sim_workload import WorkloadConfig, expected_requests, make_trace
from benchmarks.step_cost import CostModel, Profile, StepShape, fit, fit_error, shape_of
from scheduler.config import SchedulerConfig

COST = CostModel(fixed=0.01, per_decode=0.001, per_prefill=0.0002, per_decode_ctx=0.0001,
                 per_prefill_attn=0.01)
SCHED = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512,
                        block_size=16, long_prefill_token_threshold=128,
                        decode_step_prefill_tokens=64)
WORK = WorkloadConfig(num_requests=40, rate=8.0, num_system_prompts=4, system_prompt_len=96,
                      user_len=(8, 24), output_len=(4, 16), turns=(1, 4), think_time_s=0.5,
                      max_model_len=512, seed=3)


def config(policy: str = "prefix-aware", n: int = 3, **kw: Any) -> SimConfig:
    return SimConfig(num_replicas=n, policy=policy, workload=kw.pop("workload", WORK),
                     scheduler=SCHED, num_kv_blocks=kw.pop("num_kv_blocks", 160), cost=COST,
                     **kw)


@pytest.mark.parametrize("policy", ["prefix-aware", "power-of-two", "round-robin"])
def test_same_seed_same_result(policy: str) -> None:
    assert simulate(config(policy)) == simulate(config(policy))


def test_another_seed_changes_the_trace() -> None:
    a = simulate(config("round-robin"))
    b = simulate(config("round-robin", workload=replace(WORK, seed=4)))
    assert a["ttft_p50_s"] != b["ttft_p50_s"] or a["duration_s"] != b["duration_s"]


@pytest.mark.parametrize("policy", ["prefix-aware", "power-of-two", "round-robin"])
def test_every_request_finishes_once(policy: str) -> None:
    # Long answers growing in a pool of 32 blocks (512 tokens) force preemptions as well.
    work = replace(WORK, rate=30.0, output_len=(48, 96))
    sim = Simulation(config(policy, n=2, num_kv_blocks=32, workload=work))
    r = sim.run()
    n = expected_requests(make_trace(work))
    assert r["requests"] == r["finished"] == n == sum(r["requests_per_replica"])
    assert r["preemptions"] > 0
    for rec in sim.records.values():
        assert rec.first_token_s is not None and rec.finish_s is not None
        assert rec.arrival_s <= rec.first_token_s <= rec.finish_s
    for rep in sim.replicas:
        assert not rep.busy and not rep.scheduler.has_unfinished()
        rep.scheduler.check_invariants()
        assert rep.scheduler.block_manager.num_free_blocks == 32  # everything released


def test_turns_follow_their_answers() -> None:
    sim = Simulation(config("power-of-two"))
    sim.run()
    by_conv: dict[int, list[Any]] = {}
    for rec in sim.records.values():
        by_conv.setdefault(rec.conv.conv_id, []).append(rec)
    for recs in by_conv.values():
        recs.sort(key=lambda r: r.turn)
        for prev, nxt in itertools.pairwise(recs):
            assert nxt.arrival_s >= prev.finish_s  # one turn of a conversation in flight


def test_prefix_aware_hits_more_than_round_robin() -> None:
    work = replace(WORK, num_requests=120, num_system_prompts=8, turns=(3, 6))
    aware = simulate(config("prefix-aware", n=4, workload=work))
    rr = simulate(config("round-robin", n=4, workload=work))
    assert aware["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"] + 0.15
    assert aware["affinity_routed"] > 0


def test_prefix_aware_falls_back_when_the_preferred_replica_is_overloaded() -> None:
    router = PrefixAware(random.Random(0), block_size=4, capacity_blocks=100,
                         imbalance_threshold=2)
    reps = [cast(SimReplica, _Load(0)), cast(SimReplica, _Load(0))]
    prompt = list(range(40))
    first = router.choose(prompt, reps)
    assert router.choose(prompt, reps) == first and router.num_affinity == 1
    cast(Any, reps[first]).in_flight = 3  # 3 more than the other: over the threshold of 2
    assert router.choose(prompt, reps) == 1 - first  # two random replicas: the less loaded
    assert router.num_overloaded == 1


def test_prefix_aware_forgets_beyond_a_replicas_pool() -> None:
    router = PrefixAware(random.Random(0), block_size=4, capacity_blocks=10)
    reps = [cast(SimReplica, _Load(0))]
    router.choose(list(range(40)), reps)  # 10 blocks: the record is full
    router.choose(list(range(100, 140)), reps)  # 10 more blocks push the first prompt out
    router.choose(list(range(40)), reps)
    assert router.num_affinity == 0


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_router("least-tokens", 0, 16, 10, 8)


class _Load:
    def __init__(self, in_flight: int) -> None:
        self.in_flight = in_flight


# --------------------------------------------------------------------------- cost model


def test_fit_recovers_a_known_model_and_round_trips() -> None:
    rng = random.Random(0)
    points = [(d, c, p, k) for d, c, p, k in grid(False)]
    shapes = [shape_of(build_step(pt, 16, rng)) for pt in points]
    secs = [COST.step_time(s) for s in shapes]
    model = fit(shapes, secs)
    for name, want in COST.to_dict().items():
        assert getattr(model, name) == pytest.approx(want, rel=1e-6), name
    assert fit_error(model, shapes, secs)["max_rel_error"] < 1e-9
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_fit_drops_a_term_that_comes_out_negative() -> None:
    shapes = [StepShape(d, p) for d in (1, 8, 32) for p in (0, 128, 512)]
    # decode context is absent from the shapes' truth, and the noise pushes it below zero
    secs = [0.02 + 0.001 * s.decode_tokens + 0.0003 * s.prefill_tokens
            + (-1e-4 if s.decode_tokens == 32 else 0) for s in shapes]
    model = fit(shapes, secs)
    assert min(model.to_dict().values()) >= 0


def test_step_shape_of_a_scheduled_batch() -> None:
    batch = build_step((3, 100, 50, 20), 16, random.Random(0))
    s = shape_of(batch)
    assert (s.decode_tokens, s.prefill_tokens, s.decode_context) == (3, 50, 300)
    assert s.prefill_attention == 50 * (20 + 51 / 2)


def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "step-cost-test.json"
    path.write_text(json.dumps({"fit": {"coefficients": COST.to_dict()}, "num_kv_blocks": 160,
                                "block_size": 16, "device": "cpu"}))
    return path


def test_profile_loads_what_the_profiler_writes(tmp_path: Path) -> None:
    p = Profile.load(profile_file(tmp_path))
    assert (p.model, p.num_kv_blocks, p.block_size, p.device) == (COST, 160, 16, "cpu")


def test_one_command_writes_json_and_plot(tmp_path: Path) -> None:
    preset = tmp_path / "small.toml"  # 8 sequences: a short capacity run (2 x 8 conversations)
    preset.write_text("[scheduler]\nmax_num_seqs = 8\nmax_num_batched_tokens = 256\n"
                      "max_model_len = 1024\nlong_prefill_token_threshold = 128\n")
    simulate_replicas.main([
        "--profile", str(profile_file(tmp_path)), "--out", str(tmp_path), "--preset", str(preset),
        "--replicas", "1", "2",
        "--fixed-replicas", "2", "--rate-fractions", "--prefix-counts", "--skews", "1.0",
        "--requests-per-replica", "6", "--system-prompts", "2"])
    (js,) = tmp_path.glob("simulate-replicas-*.json")
    assert (tmp_path / f"{js.stem}.png").stat().st_size > 0
    data = json.loads(js.read_text())
    assert data["replica_capacity_rps"] > 0
    sweeps = [r["sweep"] for r in data["results"]]
    # replicas: 2 N x 3 policies; skew: 3 + no-overload-check; rate and prefixes skipped
    assert sweeps.count("replicas") == 6 and sweeps.count("skew") == 4 and len(sweeps) == 10
    assert all(r["finished"] == r["requests"] for r in data["results"])
