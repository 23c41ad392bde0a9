"""Top-p over candidates (engine/sample/nucleus.py): the same tokens as the full-row rule, the
old rule's kept set wherever the cut is not inside a run of equal probabilities, and a sampled
step that works in one buffer."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine.sample.nucleus import CANDIDATE_MIN, FLOORS, apply_top_p, nucleus_sample
from engine.sample.sampler import apply_min_p, sample, sample_from_probs
from engine.sample.sampling_batch import SamplingBatchBuilder
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence

V = 49152
CPU = torch.device("cpu")


def rows_of(kind: str, n: int, seed: int, vocab: int = V) -> torch.Tensor:
    """Softmax rows: flat (candidates too light: not settled), wide (nuclei past 256),
    peaked, bf16 (ties), with -inf (a grammar mask), tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g)
    if kind == "flat":
        x = x * 0.5
    elif kind == "wide":
        x = x * 3
    elif kind == "peaked":
        x = x * 7
    elif kind == "bf16":
        x = (x * 4).bfloat16().float()
    elif kind == "masked":
        x = (x * 4).masked_fill(torch.rand(n, vocab, generator=g) < 0.97, float("-inf"))
    return x.softmax(-1)


def full_row(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None,
             uniforms: torch.Tensor, after_top_p: torch.Tensor | None = None) -> torch.Tensor:
    """The full-row rule the candidates must reproduce (after_top_p: its top-p, if known)."""
    probs = apply_top_p(probs.clone(), top_p) if after_top_p is None else after_top_p.clone()
    if min_p is not None:
        apply_min_p(probs, min_p)
    return sample_from_probs(probs, uniforms)


@pytest.mark.parametrize("kind", ["wide", "peaked", "bf16", "masked"])
@pytest.mark.parametrize("p", [1e-45, 0.3, 0.9, 0.999])
def test_candidates_draw_the_full_row_rules_token(kind: str, p: float) -> None:
    """Settled rows: the full-row rule's token. A row is settled exactly when its candidates
    (p >= 2^-15) hold top_p plus the most a left-out token can weigh."""
    probs = rows_of(kind, 8, seed=int(p * 1000))
    top_p = torch.full((8,), p)
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.3, 0.0, 0.0, 0.01, 0.0])
    mass = torch.where(probs >= CANDIDATE_MIN, probs, 0.0).sum(-1, dtype=torch.float64)
    kept = apply_top_p(probs.clone(), top_p)
    for trial in range(8):
        u = torch.rand(8, generator=torch.Generator().manual_seed(trial))
        for mp in (None, min_p):
            tokens, settled = nucleus_sample(probs, top_p, mp, u)
            assert settled.tolist() == (mass.float().double() - CANDIDATE_MIN >= p).tolist()
            want = full_row(probs, top_p, mp, u, kept)
            assert torch.equal(tokens[settled], want[settled]), (kind, p, trial)
    assert p > 0.99 or settled.all()


@pytest.mark.parametrize("vocab, scale, tiers", [
    (V, 0.5, [False, True]),  # flat: not settled over 2^-15, settled over 2^-18
    (300_000, 0.01, [False, False]),  # every p < 2^-18: only the full-row rule decides
    (V, 7.0, [True, True])])
def test_rows_the_candidates_do_not_settle_get_the_full_row_rules_token(
        vocab: int, scale: float, tiers: list[bool]) -> None:
    """The sampler tries each floor in turn, then the whole row: always the same token."""
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * scale
    probs, top_p = logits.softmax(-1), torch.full((3,), 0.9)
    u = torch.rand(3, generator=torch.Generator().manual_seed(0))
    assert [bool(nucleus_sample(probs, top_p, None, u, f)[1].all()) for f in FLOORS] == tiers
    seqs = [Sequence(str(i), [1], SamplingParams(top_p=0.9, seed=i)) for i in range(3)]
    batch = SamplingBatchBuilder(vocab).build(seqs, CPU)
    assert batch.uniforms is not None
    tokens, _ = sample(logits, batch)
    assert tokens == full_row(probs, top_p, None, batch.uniforms).tolist()


def test_ties_at_the_cut_are_all_kept() -> None:
    probs = torch.tensor([[0.4, 0.1, 0.2, 0.1, 0.1, 0.1]])
    # mass before the 4th best is 0.7: top_p 0.75 reaches into the four 0.1s: all are kept
    kept = apply_top_p(probs.clone(), torch.tensor([0.75])) > 0
    assert kept.tolist() == [[True] * 6]
    draws = {int(nucleus_sample(probs, torch.tensor([0.75]), None, torch.tensor([u]))[0])
             for u in (0.05, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95)}
    assert draws == {0, 1, 2, 3, 4, 5}


def old_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The rule as commit 89075d0 wrote it (topk of 256, sort of the rows they did not
    settle), copied here to compare kept sets."""
    p = top_p.unsqueeze(1)
    vals, ids = probs.topk(256, dim=-1)
    cum = vals.cumsum(-1)
    keep = (cum - vals) < p
    keep[:, 0] = True
    out = torch.zeros_like(probs).scatter_(1, ids, vals * keep)
    wide = (cum[:, -1] < p[:, 0]).nonzero().squeeze(1)
    if wide.numel():
        svals, sids = probs[wide].sort(dim=-1, descending=True)
        skeep = (svals.cumsum(-1) - svals) < p[wide]
        skeep[:, 0] = True
        out[wide] = torch.zeros_like(svals).scatter_(1, sids, svals * skeep)
    return out


@pytest.mark.parametrize("kind", ["flat", "wide", "peaked"])
def test_the_old_rules_kept_set_where_no_probabilities_tie(kind: str) -> None:
    probs = rows_of(kind, 6, seed=3)
    for p in (0.2, 0.5, 0.9, 0.97):
        top_p = torch.full((6,), p)
        assert torch.equal(apply_top_p(probs.clone(), top_p), old_top_p(probs, top_p)), p


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(top_p=0.9),
    SamplingParams(temperature=0.7),
    SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    SamplingParams(temperature=0.5, top_k=40, min_p=0.05, logit_bias={3: 2.0})])
def test_a_sampled_step_allocates_one_full_buffer(params: SamplingParams) -> None:
    """Every row samples: one float32 [n, V] buffer for the step (the old step made four to
    six: the float copy, the processors' clone, the sampled rows' gather, the softmax,
    top-p's zero-filled scatter target, the CDF)."""
    n = 16
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(0)).mul(5).bfloat16()
    seqs = [Sequence(str(i), [1, 2, 3], params) for i in range(n)]
    batch = SamplingBatchBuilder(V, seed=0).build(seqs, CPU)
    sample(logits, batch)  # warm
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        sample(logits, batch)
    full = [e.name for e in prof.events() if e.self_cpu_memory_usage >= n * V * 4]
    assert len(full) == 1, full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_callers_logits_are_never_written(dtype: torch.dtype) -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    params = [SamplingParams(top_p=0.8), SamplingParams(temperature=0.5, top_k=5),
              SamplingParams(repetition_penalty=1.2, min_p=0.1), SamplingParams(temperature=0)]
    for batch_params in (params, params[:1] * 4, params[2:3] * 4):
        seqs = [Sequence(str(i), [1, 2], p) for i, p in enumerate(batch_params)]
        sample(logits, SamplingBatchBuilder(300, seed=0).build(seqs, CPU))
        assert torch.equal(logits, before)
