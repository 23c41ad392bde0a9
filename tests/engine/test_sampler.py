"""Sampler: each processing step on hand-made tensors, then the batched sampler end to end
(a SamplingBatch built from hand-made sequences, as the runner's prepare step builds it)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

import pytest
import torch

from engine.sample.sampler import (
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    compute_prompt_logprobs,
    sample,
    sample_from_probs,
    token_logprobs,
)
from engine.sample.sampling_batch import (
    Penalties,
    SamplingBatchBuilder,
    build_penalties,
    seeded_uniform,
)
from engine.worker.runner_output import TokenLogprobIds
from scheduler.errors import InvalidParamError
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence

V = 64
INF = float("inf")
CPU = torch.device("cpu")

SampleFn = Callable[[torch.Tensor, list[Sequence]], tuple[list[int], list]]


def make_sampler(vocab_size: int, eos_token_ids: Collection[int] = (),
                 seed: int | None = None) -> SampleFn:
    """The runner's two halves in one call: build the batch from the sequences, sample."""
    builder = SamplingBatchBuilder(vocab_size, eos_token_ids, seed)
    return lambda logits, seqs: sample(logits, builder.build(seqs, logits.device))


def penalties(prompt_ids: list[list[int]], output_ids: list[list[int]], repetition: list[float],
              presence: list[float], frequency: list[float], vocab: int = V) -> Penalties:
    rows = list(range(len(prompt_ids)))
    return build_penalties(rows, prompt_ids, output_ids, repetition, presence, frequency, CPU,
                           vocab)


def make_seq(params: SamplingParams, prompt: list[int] | None = None,
             output: tuple[int, ...] = (), seq_id: str = "s") -> Sequence:
    seq = Sequence(seq_id, prompt or [1, 2, 3], params)
    for t in output:
        seq.append_token(t)
    return seq


def random_logits(rows: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


def draw_many(sampler: SampleFn, logits: torch.Tensor, params: SamplingParams,
              n: int = 400) -> list[int]:
    """n draws from one row, batched as n copies of the row (unseeded)."""
    tokens, _ = sampler(logits.expand(n, -1).contiguous(),
                        [make_seq(params, seq_id=str(i)) for i in range(n)])
    return tokens


# ---------------------------------------------------------------------------------------
# Processing steps


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 4.0, -1.0, 0.0]])
    # tokens 0, 1, 4 in the prompt, token 3 generated three times; 9 is past the head
    apply_penalties(logits, penalties([[0, 1, 4, 1, 9]], [[3, 3, 3]], [2.0], [0.0], [0.0], 5))
    assert logits.tolist() == [[1.0, -4.0, 4.0, -2.0, 0.0]]


def test_presence_and_frequency_cover_output_tokens_only() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    # prompt-only token 0 is not penalised; outputs: token 1 once, 2 three times, 3 twice
    apply_penalties(logits, penalties([[0, 0]], [[2, 1, 2, 3, 2, 3]], [1.0], [0.5], [0.25]))
    assert logits.tolist() == [[1.0, 1.0 - 0.5 - 0.25, 1.0 - 0.5 - 0.75, -1.0 - 0.5 - 0.5]]


def test_penalties_are_per_row_and_keep_minus_inf() -> None:
    logits = torch.tensor([[2.0, -INF], [2.0, 2.0]])
    apply_penalties(logits, penalties([[], []], [[0, 1], [0]], [2.0, 1.0], [0.0, 1.0],
                                      [0.0, 0.0]))
    assert logits.tolist() == [[1.0, -INF], [1.0, 2.0]]


def test_repetition_penalty_matches_hugging_face() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = random_logits(2, seed=9)
    ids = torch.tensor([[3, 5, 5, 60, 0], [7, 7, 8, 9, 10]])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    ours = apply_penalties(logits.clone(), penalties(ids.tolist(), [[], []], [1.3] * 2,
                                                     [0.0] * 2, [0.0] * 2))
    assert torch.equal(ours, expected)


def test_top_k_keeps_k_best_per_row() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    apply_top_k(logits, torch.tensor([2, 1]), 2)
    assert logits.tolist() == [[-INF, 5.0, -INF, 4.0], [4.0, -INF, -INF, -INF]]


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.1, 0.5, 0.15, 0.25]])
    apply_top_p(probs, torch.tensor([0.7, 0.75]))  # 0.5 + 0.25 = 0.75 reaches both
    expected = [[0.0, 0.5, 0.0, 0.25]] * 2
    assert torch.allclose(probs, torch.tensor(expected))
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    apply_top_p(probs, torch.tensor([0.76]))
    assert (probs > 0).tolist() == [[False, True, True, True]]


def test_top_p_wide_nucleus_falls_back_to_full_sort() -> None:
    # 1000 nearly equal tokens: top-256 cannot reach p = 0.9, so the sorted path decides.
    probs = torch.linspace(1.0, 2.0, 1000).unsqueeze(0)
    probs /= probs.sum()
    expected = probs.clone()
    order = expected.argsort(descending=True)
    cum = expected[0, order[0]].cumsum(0)
    keep = order[0][(cum - expected[0, order[0]]) < 0.9]
    apply_top_p(probs, torch.tensor([0.9]))
    assert set((probs[0] > 0).nonzero().squeeze(1).tolist()) == set(keep.tolist())
    assert 256 < len(keep) < 1000


@pytest.mark.parametrize("p", [0.0, 5e-324, 1e-45])  # 5e-324 and 1e-45 are 0 in float32
def test_top_p_keeps_the_best_token_whatever_p(p: float) -> None:
    """vLLM's rule: top-p keeps at least one token. Issue 38: top_p 5e-324 kept none, and the
    draw returned the id one past the vocabulary."""
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    apply_top_p(probs, torch.tensor([p], dtype=torch.float32))
    assert (probs > 0).tolist() == [[False, True, False, False]]


def test_min_p_drops_below_fraction_of_max() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.1, 0.15], [0.4, 0.4, 0.1, 0.1]])
    before = probs.clone()
    apply_min_p(probs, torch.tensor([0.5, 0.3]))  # thresholds 0.25 (kept: p >= threshold) and 0.12
    keep = torch.tensor([[True, True, False, False], [True, True, False, False]])
    assert torch.equal(probs, torch.where(keep, before, 0.0))


def test_sample_from_probs_inverse_cdf_skips_zero_mass() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]] * 4)
    tokens = sample_from_probs(probs, torch.tensor([0.0, 0.2, 0.3, 0.99999994]))
    assert tokens.tolist() == [1, 1, 3, 3]
    # u rounding up to 1.0 must still land on the last token with mass.
    assert sample_from_probs(torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([1.0])).tolist() == [1]


def test_seeded_uniform_is_a_pure_function() -> None:
    assert seeded_uniform(7, 3) == seeded_uniform(7, 3)
    values = {seeded_uniform(7, s) for s in range(100)} | {seeded_uniform(-1, 0)}
    assert len(values) == 101 and all(0.0 <= u < 1.0 for u in values)


def test_token_logprobs_values_ranks_and_top_n() -> None:
    logprobs = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 0.9]]).log_softmax(-1)
    found = token_logprobs(logprobs, torch.tensor([2, 3]), [3, 0])
    assert found[0].token_id == 2 and found[0].rank == 2
    assert found[0].logprob == pytest.approx(logprobs[0, 2].item())
    assert found[0].top_ids == (1, 2, 0)
    assert list(found[0].top_logprobs) == sorted(found[0].top_logprobs, reverse=True)
    assert found[1] == TokenLogprobIds(3, logprobs[1, 3].item(), 1, (), ())


def test_compute_prompt_logprobs_on_hand_made_logits() -> None:
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)], [5.0, 0.0, 0.0]])
    found = compute_prompt_logprobs(logits, torch.tensor([0, 0]), top_n=2)
    assert found[0].logprob == pytest.approx(math.log(0.25))
    assert found[0].rank == 2 and found[0].top_ids[0] == 2
    assert found[0].top_logprobs[0] == pytest.approx(math.log(0.5))
    assert found[1].rank == 1 and found[1].top_ids[0] == 0 and len(found[1].top_ids) == 2


# ---------------------------------------------------------------------------------------
# The batched sampler


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = random_logits(8)
    before = logits.clone()
    tokens, logprobs = make_sampler(V)(logits, [make_seq(SamplingParams(temperature=0))] * 8)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == [None] * 8 and torch.equal(logits, before)


def test_tiny_temperature_is_greedy() -> None:
    logits = random_logits(4, seed=2)
    seqs = [make_seq(SamplingParams(temperature=1e-7), seq_id=str(i)) for i in range(4)]
    assert make_sampler(V, seed=0)(logits, seqs)[0] == logits.argmax(-1).tolist()


def test_padded_vocab_columns_are_never_sampled() -> None:
    logits = torch.zeros(2, V + 8)
    logits[:, V:] = 100.0  # a padded LM head's extra columns
    greedy, sampled = SamplingParams(temperature=0), SamplingParams()
    tokens, _ = make_sampler(V)(logits, [make_seq(greedy), make_seq(sampled)])
    assert all(t < V for t in tokens)


def test_greedy_applies_penalties() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    tokens, _ = make_sampler(V)(logits, [make_seq(params, prompt=[5])])
    assert tokens == [6]


def test_seeded_row_is_independent_of_batch_and_position() -> None:
    sampler = make_sampler(V)
    row = random_logits(1, seed=1, scale=1.0)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = [sampler(row, [make_seq(params, output=(9,) * step)])[0][0] for step in range(30)]
    others = [SamplingParams(temperature=0.7), SamplingParams(seed=5, top_k=3),
              SamplingParams(temperature=0), SamplingParams(min_p=0.1, presence_penalty=1.0)]
    for step in range(30):
        for position in (0, 2, 4):
            batch = [make_seq(p, seq_id=str(i)) for i, p in enumerate(others)]
            batch.insert(position, make_seq(params, output=(9,) * step))
            logits = random_logits(5, seed=step)
            logits[position] = row[0]
            assert sampler(logits, batch)[0][position] == alone[step]
    assert len(set(alone)) > 3  # the seed still varies the draw from step to step


def test_different_seeds_differ() -> None:
    sampler, row = make_sampler(V), random_logits(1, seed=3, scale=0.5)
    runs = [[sampler(row, [make_seq(SamplingParams(seed=seed), output=(1,) * step)])[0][0]
             for step in range(20)] for seed in (1, 2)]
    assert runs[0] != runs[1]


def test_unseeded_sampler_seed_reproduces() -> None:
    logits = random_logits(16, scale=0.5)
    seqs = [make_seq(SamplingParams(), seq_id=str(i)) for i in range(16)]
    assert make_sampler(V, seed=3)(logits, seqs)[0] == make_sampler(V, seed=3)(logits, seqs)[0]


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=3), {10, 11, 12}),
    (SamplingParams(top_p=0.7), {10, 11}),  # 0.58 + 0.21 reaches 0.7
    (SamplingParams(min_p=0.3), {10, 11}),  # 0.21 >= 0.3 * 0.58; 0.08 is not
    (SamplingParams(top_k=4, top_p=0.9, min_p=0.1), {10, 11, 12}),
])
def test_truncation_never_samples_outside_allowed_set(params: SamplingParams,
                                                      allowed: set[int]) -> None:
    logits = torch.full((1, V), -3.0)
    logits[0, 10:14] = torch.tensor([3.0, 2.0, 1.0, 0.5])  # p = .58 .21 .08 .05, rest .0014
    drawn = set(draw_many(make_sampler(V, seed=0), logits, params))
    assert drawn == allowed


def test_temperature_sharpens() -> None:
    logits = torch.zeros(1, V)
    logits[0, 0], logits[0, 1] = 1.0, 0.0
    logits[0, 2:] = -INF
    hot = draw_many(make_sampler(V, seed=1), logits, SamplingParams(temperature=1.0), n=2000)
    cold = draw_many(make_sampler(V, seed=1), logits, SamplingParams(temperature=0.25), n=2000)
    p_hot, p_cold = 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-4))  # 0.73, 0.98
    assert hot.count(0) / 2000 == pytest.approx(p_hot, abs=0.04)
    assert cold.count(0) / 2000 == pytest.approx(p_cold, abs=0.02)


def test_logit_bias_forces_and_bans() -> None:
    logits = random_logits(1, seed=4)
    top = int(logits.argmax())
    forced = draw_many(make_sampler(V, seed=0), logits, SamplingParams(logit_bias={7: 100.0}), 50)
    assert set(forced) == {7}
    banned = SamplingParams(temperature=0, logit_bias={top: -100.0})
    assert make_sampler(V)(logits, [make_seq(banned)])[0][0] != top
    sampled = draw_many(make_sampler(V, seed=0), logits, SamplingParams(logit_bias={top: -100.0}))
    assert top not in sampled


def test_min_tokens_forbids_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, 2], logits[0, 3], logits[0, 4] = 50.0, 40.0, 30.0  # EOS 2, stop id 3
    sampler = make_sampler(V, eos_token_ids=[2])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(3,))
    assert sampler(logits, [make_seq(params)])[0] == [4]
    assert sampler(logits, [make_seq(params, output=(9,))])[0] == [4]
    assert sampler(logits, [make_seq(params, output=(9, 9))])[0] == [2]
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(logits, [make_seq(ignore)])[0] == [2]  # EOS is a plain token here
    sampled = draw_many(sampler, logits, SamplingParams(min_tokens=1, stop_token_ids=(3,)), 50)
    assert set(sampled) == {4}


def test_sampler_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(3, seed=5)
    params = [SamplingParams(temperature=0.5, logprobs=4, repetition_penalty=1.5,
                             logit_bias={0: 5.0}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0, logit_bias={1: 100.0})]
    seqs = [make_seq(p, prompt=[0, 1], seq_id=str(i)) for i, p in enumerate(params)]
    tokens, found = make_sampler(V, seed=0)(logits, seqs)
    expected = logits.log_softmax(-1)
    first = found[0]
    assert first is not None and found[1] is None
    assert first.token_id == tokens[0]
    assert first.logprob == pytest.approx(expected[0, tokens[0]].item())
    assert first.rank == int((expected[0] > expected[0, tokens[0]]).sum()) + 1
    assert list(first.top_ids) == expected[0].topk(4).indices.tolist()
    assert list(first.top_logprobs) == pytest.approx(expected[0].topk(4).values.tolist())
    third = found[2]
    assert third is not None and tokens[2] == 1 and third.top_ids == ()
    assert third.logprob == pytest.approx(expected[2, 1].item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_the_first_of_tied_maxima_like_argmax(dtype: torch.dtype) -> None:
    """_choose takes max(dim).indices (faster than argmax on the CPU): on ties it must give
    argmax's answer, the first index, or greedy output would drift from HF's."""
    vocab = 49152  # the real vocabulary size: the CPU reduction splits long rows
    logits = torch.randint(0, 4, (9, vocab), generator=torch.Generator().manual_seed(0))
    logits = logits.to(dtype)
    logits[3, [7, 30000]] = 10.0  # one tie far apart
    seqs = [make_seq(SamplingParams(temperature=0.0), seq_id=str(i)) for i in range(9)]
    tokens, _ = make_sampler(vocab)(logits, seqs)
    assert tokens == logits.float().argmax(dim=-1).tolist()
    assert tokens[3] == 7


def test_plain_greedy_rows_get_the_tokens_of_the_full_path() -> None:
    """An all-greedy batch without logprobs takes the max of the raw (bf16) logits; asking for
    logprobs sends the same rows through the fp32 path: the same tokens."""
    logits = torch.randn(6, 4000, generator=torch.Generator().manual_seed(1)).bfloat16()
    plain = [make_seq(SamplingParams(temperature=0.0), seq_id=str(i)) for i in range(6)]
    with_lp = [make_seq(SamplingParams(temperature=0.0, logprobs=2), seq_id=str(i))
               for i in range(6)]
    tokens, lps = make_sampler(4000)(logits, plain)
    tokens_lp, lps_lp = make_sampler(4000)(logits, with_lp)
    assert tokens == tokens_lp == logits.float().argmax(dim=-1).tolist()
    assert lps == [None] * 6 and all(lp is not None for lp in lps_lp)


# The extremes a float field can carry in JSON: zeros, subnormals (0 in float32), float32's
# edges, the bounds of each field and their neighbours, float64's largest.
EXTREMES = (0.0, -0.0, 5e-324, -5e-324, 2.2e-308, 1e-45, 1.2e-38, 1e-5, 9.9e-5, 1e-4, 0.5,
            0.9999999, 1.0, 1.0000001, 2.0, 2.0000001, -2.0, -2.0000001, -1.0, 100.0, 100.0001,
            -100.0, -100.0001, 1e4, 10000.001, 3.4028234663852886e38, 3.5e38, 1e308,
            1.7976931348623157e308, -1e308)
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "logit_bias")


def params_with(name: str, value: float) -> SamplingParams:
    """A sampled request (logprobs too) whose one float field is `value`."""
    fields: dict = {"temperature": 1.0, "logprobs": 2, "seed": 3}
    fields[name] = {5: value} if name == "logit_bias" else value
    return SamplingParams(**fields)


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_extreme_floats_give_a_field_error_or_a_token_in_the_vocabulary(name: str) -> None:
    """Issue 38: every value either is refused naming its field, or the real sampler draws a
    token in the vocabulary with finite logprobs, on logits that include -inf (a grammar's
    mask) and from a row whose penalties see its tokens."""
    logits = random_logits(1, seed=4)
    logits[0, 40:] = -INF
    builder = SamplingBatchBuilder(V, seed=0)
    refused = 0
    for value in EXTREMES:
        try:
            params = params_with(name, value)
        except InvalidParamError as e:
            assert e.param == name, (value, e.param)
            refused += 1
            continue
        seq = make_seq(params, prompt=[1, 2, 5, 7], output=(5, 9, 9))
        tokens, logprobs = sample(logits.clone(), builder.build([seq], CPU))
        assert 0 <= tokens[0] < V, (name, value, tokens)
        assert logprobs[0] is not None and math.isfinite(logprobs[0].logprob), (name, value)
    assert 0 < refused < len(EXTREMES)
