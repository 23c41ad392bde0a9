"""Batch-invariant mode: a sequence's logits are bitwise the same whatever else is in its
steps and however its prompt is chunked (bfloat16, the default dtype on this CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.layers import batch_invariant
from engine.worker.model_runner import ModelRunner
from scheduler.sequence import Sequence
from tests.support.models import build_checkpoint, drive, greedy_seq, loaded_runner, tiny_config

TARGET = list(range(20, 43))  # 23 tokens: crosses several 4-token KV blocks
OTHERS = [[5, 9, 13, 200, 17], [42] * 3 + list(range(60, 90)), list(range(100, 113)), [7],
          list(range(150, 190))]


def target_logits(runner: ModelRunner, others: list[list[int]], chunk: int,
                  starts: list[int]) -> list[torch.Tensor]:
    """The target's logits row at each step where it samples, with `others` in the batch."""
    seen: list[torch.Tensor] = []
    original = runner._sample

    def capture(step, logits, output, batch, masks):  # type: ignore[no-untyped-def]
        if step.sample_rows is not None and "target" in step.sample_ids:
            row = step.sample_rows[step.sample_ids.index("target")]
            seen.append(logits[row].clone())
        original(step, logits, output, batch, masks)

    seqs: list[Sequence] = [greedy_seq(f"o{i}", p, 10) for i, p in enumerate(others)]
    seqs.append(greedy_seq("target", TARGET, 8))
    runner._sample = capture  # type: ignore[method-assign]
    try:
        drive(runner, seqs, chunk=chunk, start_step=starts)
    finally:
        del runner._sample  # back to the class's method
    return seen


@pytest.fixture(scope="module", params=["llama", "qwen3", "mistral_window"])
def invariant_runner(request: pytest.FixtureRequest,
                     tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    """mistral_window: every layer slides over 8 tokens, so the 23-token target outgrows it
    (issue 33: the tiles and the decode groups take the window)."""
    if request.param == "mistral_window":
        folder = build_checkpoint(tmp_path_factory.mktemp("tiny-mistral-bi"), "mistral_window")
    else:
        folder = request.getfixturevalue(f"tiny_{request.param}")
    return loaded_runner(tiny_config(folder, dtype="bfloat16", batch_invariant=True,
                                     num_kv_blocks=256))


def test_logits_are_bitwise_identical_across_batch_compositions(
        invariant_runner: ModelRunner) -> None:
    alone = target_logits(invariant_runner, [], chunk=64, starts=[0])
    assert len(alone) == 8 and alone[0].dtype == torch.bfloat16
    compositions = [  # (others, prefill chunk, the step each sequence joins; target last)
        (OTHERS, 64, [0, 0, 1, 2, 0, 3]),
        (OTHERS[:3], 3, [0, 2, 1, 0]),  # the target's prompt in 3-token chunks among decodes
        (OTHERS, 5, [3, 0, 0, 1, 2, 0]),
        (OTHERS[1:2] * 3, 7, [0, 1, 2, 4]),
    ]
    for others, chunk, starts in compositions:
        busy = target_logits(invariant_runner, others, chunk, starts)
        assert len(busy) == len(alone)
        for step, (a, b) in enumerate(zip(alone, busy, strict=True)):
            assert torch.equal(a, b), (chunk, starts, step, (a.float() - b.float()).abs().max())


def test_tiles_give_each_row_the_same_bits_at_any_position() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 80, dtype=torch.bfloat16)
    batch_invariant.enable(linear, rows=8)
    x = torch.randn(1, 37, 96, dtype=torch.bfloat16)
    alone = linear(x[:, 5:6])[0, 0]
    for n in (1, 6, 8, 9, 37):
        for pos in range(min(n, 8)):
            batch = torch.randn(1, n, 96, dtype=torch.bfloat16)
            batch[0, pos] = x[0, 5]
            assert torch.equal(linear(batch)[0, pos], alone), (n, pos)


def test_enable_wraps_per_token_modules_once(tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    # 2 layers x (q, k, v, o, MLP, 2 norms) + final norm + lm_head + rotary
    assert batch_invariant.enable(model) == 2 * 7 + 3


@pytest.mark.parametrize("window, softcap, sinks", [
    (0, 0.0, False), (1, 0.0, False), (5, 0.0, False), (8, 0.0, False), (30, 0.0, False),
    (0, 0.7, False), (5, 0.7, False), (0, 0.0, True), (5, 0.7, True)])
def test_the_tiles_take_a_window_soft_cap_and_sinks_as_the_torch_path(
        window: int, softcap: float, sinks: bool) -> None:
    """The tiled prefill (c = 6 computed, a 13-token chunk, blocks of 4) against SDPA with
    the same causal, windowed mask (fp32), or the torch path's explicit attention where SDPA
    cannot apply the soft cap or the sinks."""
    from engine.attention.invariant import tiled_prefill_attention
    from engine.attention.paged import causal, explicit_attention, windowed
    from engine.attention.scores import ScoreRule

    gen = torch.Generator().manual_seed(0)
    c, n, bs, heads, kv_heads, hd = 6, 13, 4, 4, 2, 8
    width = -(-(c + n) // bs) * bs
    q = torch.randn(heads, n, hd, generator=gen)
    k, v = (torch.randn(kv_heads, width, hd, generator=gen) for _ in range(2))
    rule = ScoreRule(window, softcap, torch.linspace(-1.0, 2.0, heads) if sinks else None)
    got = tiled_prefill_attention(q, k, v, c, bs, 0.3, rule)
    mask = causal(n, c, q.device)
    mask = windowed(mask, c, window) if window else mask
    ks, vs = k[None, :, :c + n], v[None, :, :c + n]
    if not rule.plain:
        want = explicit_attention(q[None], ks, vs, mask, 0.3, rule)[0].transpose(0, 1)
    else:
        want = torch.nn.functional.scaled_dot_product_attention(
            q[None], ks, vs, attn_mask=mask, scale=0.3, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_released_window_blocks_keep_positions_absolute(invariant_runner: ModelRunner,
                                                        llama_runner: ModelRunner) -> None:
    """Blocks released out of a sliding window: the usual step shifts the rest of the table
    to start at 0; batch-invariant mode reads them as block 0 (masked) instead, because its
    tile widths follow the position and the shift follows how the prompt was chunked (a
    150-token prompt in one chunk or in 40-token chunks gave other bf16 bits before)."""
    from scheduler.block_manager import NULL_BLOCK

    table = [NULL_BLOCK, NULL_BLOCK, 5, 7]
    assert invariant_runner._held_blocks(table) == ([0, 0, 5, 7], 0)
    assert llama_runner._held_blocks(table) == ([5, 7], 2 * llama_runner.block_size)
    assert invariant_runner._held_blocks([3, 4]) == ([3, 4], 0)
