"""compile_ceiling: the op split, the step builder, the interleaved timing and the ratios."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.compile_ceiling import (
    Split,
    build_step,
    ceiling,
    kind_of,
    profile_step,
    split_self_times,
    time_steps,
    workload_ratios,
    workload_steps,
)


@pytest.mark.parametrize(("name", "kind"), [
    ("mkldnn::_linear_pointwise", "linear"),
    ("pagedserve::packed_linear", "linear"),
    ("aten::_weight_int4pack_mm_for_cpu", "linear"),
    ("aten::_weight_int8pack_mm", "linear"),
    ("aten::mm", "linear"),
    ("aten::addmm", "linear"),
    ("pagedserve_cpu::paged_decode_step", "attention"),
    ("pagedserve::paged_attention", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::bmm", "attention"),
    ("aten::max", "rest"),
    ("## Call CompiledFxGraph fxyz ##", "rest"),
    ("aten::add", "rest"),
])
def test_kind_of_sorts_the_ops_a_step_calls(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_split_self_times_is_per_step_milliseconds() -> None:
    us = {"aten::mm": 4000.0, "aten::bmm": 2000.0, "aten::add": 1000.0, "aten::addmm": 2000.0}
    assert split_self_times(us, steps=2) == {"linear": 3.0, "attention": 1.0, "rest": 0.5}


class FakeRunner:
    """execute() runs a matmul (a 'linear') and a bmm (an 'attention'), and counts calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.x, self.w = torch.randn(64, 256), torch.randn(256, 256)
        self.q = torch.randn(8, 64, 64)

    def execute(self, step: str) -> None:
        self.calls.append(step)
        torch.mm(self.x, self.w)
        torch.bmm(self.q, self.q)


def test_profile_step_finds_the_linear_and_the_attention_time() -> None:
    runner = FakeRunner()
    prof = profile_step(runner, "step", n=3)
    assert runner.calls == ["step"] * 3
    assert prof["linear"] > 0 and prof["attention"] > 0


def test_time_steps_runs_every_mode_and_shape_alike() -> None:
    runners = {"eager": FakeRunner(), "compiled": FakeRunner()}
    medians = time_steps(runners, {"decode": "d", "prefill": "p"}, repeats=3, seed=0)
    assert set(medians) == {(m, s) for m in runners for s in ("decode", "prefill")}
    assert all(ms > 0 for ms in medians.values())
    for r in runners.values():  # 2 warm-up calls and 3 timed ones per shape
        assert sorted(r.calls) == ["d"] * 5 + ["p"] * 5


def test_build_step_gives_every_row_its_own_blocks() -> None:
    step = build_step(3, 40, 2, 20, block_size=16, pool_blocks=100, rng=random.Random(0))
    assert step.num_scheduled_tokens == [1, 1, 1, 20, 20]
    assert [s.num_computed_tokens for s in step.seqs] == [39, 39, 39, 0, 0]
    tables = [s.block_table for s in step.seqs]
    assert [len(t) for t in tables] == [3, 3, 3, 2, 2]  # ceil(40 / 16), ceil(20 / 16)
    flat = [b for t in tables for b in t]
    assert len(set(flat)) == len(flat) == 13
    with pytest.raises(ValueError, match="13 KV blocks"):
        build_step(3, 40, 2, 20, block_size=16, pool_blocks=12, rng=random.Random(0))


def test_the_ceiling_counts_only_the_linears_and_the_attention() -> None:
    compiled = Split(step_ms=80.0, linear_ms=50.0, attention_ms=20.0)
    assert compiled.rest_ms == 10.0
    assert ceiling(91.0, compiled) == pytest.approx(1.3)


def test_workload_ratios_weigh_decode_and_prefill_steps() -> None:
    steps = workload_steps(requests=128, output_tokens=128, decodes=64, prefill_prompts=10)
    assert steps == (256.0, 12.8)
    eager = {"decode": 90.0, "prefill": 800.0}
    compiled = {"decode": Split(75.0, 50.0, 20.0), "prefill": Split(720.0, 500.0, 150.0)}
    r = workload_ratios(eager, compiled, (2.0, 1.0))
    assert r["measured"] == pytest.approx((2 * 90 + 800) / (2 * 75 + 720))
    assert r["ceiling"] == pytest.approx((2 * 90 + 800) / (2 * 70 + 650))
