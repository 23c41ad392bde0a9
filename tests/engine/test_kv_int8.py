"""The int8 KV cache (engine/attention/kv_int8.py, --kv-cache-dtype int8): the row format, the
torch path and the C++ kernel against their own reference math (the same attention over the
dequantized pool), the two writers giving the same bytes, and the pool's size. The engine
end to end, against Hugging Face with the same quantization, and the perplexity bound on the
real model: tests/engine/test_kv_int8_smollm2.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.attention import cpu_kernels, kv_int8
from engine.attention.paged import AttentionMetadata, attend, attend_step
from engine.attention.scores import ScoreRule
from engine.worker.model_runner import ModelRunner
from tests.engine.test_cpu_kernels import BLOCK, HEAD_DIM, HEADS, KV_HEADS, _table
from tests.engine.test_cpu_kernels import mixed_step as kernels_step
from tests.support.models import loaded_runner, tiny_config

SCALE = HEAD_DIM ** -0.5
CPU = torch.device("cpu")


def needs_kernel() -> None:
    if not cpu_kernels.paged_decode_available():
        pytest.skip("the CPU paged-decode kernel did not build here (no g++?)")


# ----------------------------------------------------------------------------- the row format


def test_a_row_is_its_codes_then_its_float16_scale() -> None:
    x = torch.tensor([[0.5, -1.27, 0.0, 1.27]])
    row = kv_int8.quantize(x)
    assert row.dtype == torch.int8 and row.shape == (1, 4 + kv_int8.SCALE_BYTES)
    scale = row[:, 4:].view(torch.float16)
    assert scale.item() == torch.tensor(1.27 / 127, dtype=torch.float16).item()
    assert row[0, :4].tolist() == [50, -127, 0, 127]
    assert torch.equal(kv_int8.quantize(-x)[:, :4], -row[:, :4])  # symmetric


def test_dequantized_rows_are_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, HEAD_DIM, generator=gen) * torch.logspace(-3, 2, 7)[None, :, None]
    rows = kv_int8.quantize(x)
    back = kv_int8.dequantize(rows, torch.float32)
    step = rows[..., HEAD_DIM:].view(torch.float16).float()  # [5, 7, 1]
    assert (back - x).abs().le(step * 0.5 + 1e-7).all()
    assert torch.equal(kv_int8.dequantize(kv_int8.quantize(torch.zeros(3, HEAD_DIM)),
                                          torch.float32), torch.zeros(3, HEAD_DIM))


def test_a_huge_row_saturates_instead_of_reading_back_nan() -> None:
    """amax / 127 above float16's largest: the scale stops there and the codes saturate (an
    inf scale would read back as NaN, and the torch path's padded decodes read block 0)."""
    x = torch.tensor([[1e7, -2e7, 3.0, 0.0]])
    back = kv_int8.dequantize(kv_int8.quantize(x), torch.float32)
    assert torch.isfinite(back).all()
    assert back[0, :2].tolist() == [127 * kv_int8.SCALE_MAX, -127 * kv_int8.SCALE_MAX]


def test_a_strided_gather_of_rows_dequantizes_in_place() -> None:
    rows = kv_int8.quantize(torch.randn(6, BLOCK, HEAD_DIM))  # [blocks, bs, hd + 2]
    picked = rows.view(6, -1).index_select(0, torch.tensor([4, 1])).view(2, BLOCK, -1)[:, 3:9]
    assert torch.equal(kv_int8.dequantize(picked, torch.float32),
                       kv_int8.dequantize(rows[[4, 1], 3:9].contiguous(), torch.float32))


def test_the_width_and_head_dim_of_a_pool() -> None:
    assert kv_int8.row_width(64, int8=True) == 66 and kv_int8.row_width(64, int8=False) == 64
    assert kv_int8.head_dim_of(torch.zeros(2, 66, dtype=torch.int8)) == 64
    assert kv_int8.head_dim_of(torch.zeros(2, 64, dtype=torch.bfloat16)) == 64


# ----------------------------------------------------------------------------- one layer's step


def mixed_step(decodes: list[int], prefills: list[tuple[int, int]], dtype: torch.dtype,
               int8: bool, kernel: bool, rule: ScoreRule | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """test_cpu_kernels' step of one layer over a shuffled pool already holding every
    context (the same values either way; int8: quantized from them), as q [H, T, hd] and the
    new K/V [2, kvH, T, hd]."""
    pool, q, kv, meta = kernels_step(decodes, prefills, dtype, kernel=kernel, int8=int8,
                                     rule=rule)
    return pool, q[0], kv[:, 0], meta


def step(decodes: list[int], prefills: list[tuple[int, int]], dtype: torch.dtype, int8: bool,
         kernel: bool, rule: ScoreRule | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's output [T, H, hd] and the pool after it."""
    pool, q, kv, meta = mixed_step(decodes, prefills, dtype, int8, kernel, rule=rule)
    with torch.inference_mode():
        return attend_step(q[None], kv[0][None], kv[1][None], 0, SCALE, meta)[0], pool


DECODES = [1, 15, 16, 17, 100, 333, 40]  # block edges, one token, long and short
PREFILLS = [(40, 0), (7, 33), (1, 16)]  # a fresh prompt, chunks after cached tokens


def test_the_torch_path_is_the_float_path_over_the_dequantized_pool() -> None:
    """Its own reference math: the int8 step's output is the float step's over a pool holding
    the dequantized values, the new tokens' K/V quantized as written (a fresh prompt's own
    K/V, computed in this step, are used as computed)."""
    pool, q, kv, meta = mixed_step(DECODES, PREFILLS, torch.float32, True, False)
    written = pool.clone()
    for i in range(2):  # K then V: [T, kvH, hd + 2] into pool[block, :, offset]
        written[0, i, meta.write_blocks, :, meta.write_offsets] = (
            kv_int8.quantize(kv[i]).transpose(0, 1))
    with torch.inference_mode():
        out = attend(q, kv[0], kv[1], 0, SCALE, meta)
    assert torch.equal(pool, written)  # each new row, quantized into its slot
    ref_pool, _, _, ref_meta = mixed_step(DECODES, PREFILLS, torch.float32, False, False)
    ref_pool.copy_(kv_int8.dequantize(pool, torch.float32))
    with torch.inference_mode():
        fresh = slice(len(DECODES), len(DECODES) + PREFILLS[0][0])  # the c == 0 prompt's rows
        kq = kv_int8.dequantize(kv_int8.quantize(kv), torch.float32)
        kq[:, :, fresh] = kv[:, :, fresh]
        expected = attend(q, kq[0], kq[1], 0, SCALE, ref_meta)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_stays_close_to_the_float_pool(dtype: torch.dtype) -> None:
    """What the quantization costs one layer: within a few percent of the output's scale."""
    out, _ = step(DECODES, PREFILLS, dtype, int8=True, kernel=False)
    full, _ = step(DECODES, PREFILLS, dtype, int8=False, kernel=False)
    err = (out.float() - full.float()).abs().max() / full.float().abs().max()
    assert 0 < err < 0.03, err


def test_the_kernel_and_the_torch_writer_store_the_same_bytes() -> None:
    needs_kernel()
    for dtype in (torch.float32, torch.bfloat16):
        _, fused = step(DECODES, PREFILLS, dtype, int8=True, kernel=True)
        _, unfused = step(DECODES, PREFILLS, dtype, int8=True, kernel=False)
        assert torch.equal(fused, unfused), dtype
    # Rows of every magnitude, the saturating one included, through the fused op's writes.
    pool, q, kv, meta = mixed_step([5, 20], [], torch.float32, True, True)
    kv = kv * torch.logspace(-4, 7, kv.shape[-2])[None, None, :, None]
    torch_pool = pool.clone()
    with torch.inference_mode():
        attend_step(q[None], kv[0][None], kv[1][None], 0, SCALE, meta)
        attend(q, kv[0], kv[1], 0, SCALE, dataclasses.replace(meta, kv_cache=torch_pool,
                                                              fused_step=False))
    assert torch.equal(pool, torch_pool)


RULES = [None, ScoreRule(7, 0.0, None), ScoreRule(40, 30.0, torch.linspace(-2.0, 3.0, HEADS))]


@pytest.mark.parametrize("rule", RULES, ids=["plain", "window", "window+softcap+sinks"])
def test_the_kernel_matches_the_torch_path_in_float32(rule: ScoreRule | None) -> None:
    needs_kernel()
    torch.testing.assert_close(step(DECODES, PREFILLS, torch.float32, True, True, rule)[0],
                               step(DECODES, PREFILLS, torch.float32, True, False, rule)[0],
                               atol=1e-5, rtol=1e-5)


def test_in_bfloat16_the_kernel_is_at_least_as_close_to_float64_as_the_torch_path() -> None:
    """The kernel dequantizes into float32 registers; the torch path rounds the dequantized
    K/V to bfloat16 before its bmm. Both against the same math in float64."""
    needs_kernel()
    kernel = step(DECODES, [], torch.bfloat16, True, True)[0].double()
    torch_path = step(DECODES, [], torch.bfloat16, True, False)[0].double()
    pool, q, kv, meta = mixed_step(DECODES, [], torch.bfloat16, True, False)
    with torch.inference_mode():
        attend(q, kv[0], kv[1], 0, SCALE, meta)  # writes the new rows
    k_pool, v_pool = kv_int8.dequantize(pool[0], torch.float64)
    expected = []
    for i, ctx in enumerate(DECODES):
        table = _table(meta, i)
        k = k_pool[table].transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM)[:, :ctx]
        v = v_pool[table].transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM)[:, :ctx]
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, 0) for t in (k, v))
        scores = q[:, i:i + 1].double() @ k.transpose(1, 2) * SCALE
        expected.append((scores.softmax(-1) @ v)[:, 0])
    reference = torch.stack(expected)
    assert (kernel - reference).abs().max() <= (torch_path - reference).abs().max() + 1e-6
    assert (kernel - reference).abs().max() < 2e-2


def test_the_fused_step_equals_the_unfused_kernel_path() -> None:
    """paged_decode_step (write + attend in one call) against attend() with the kernel's
    decode op and the torch writes: the same bits and the same pool."""
    needs_kernel()
    pool, q, kv, meta = mixed_step(DECODES, PREFILLS, torch.bfloat16, True, True)
    assert meta.fused_step
    unfused = dataclasses.replace(meta, kv_cache=pool.clone(), fused_step=False)
    with torch.inference_mode():
        expected = attend(q, kv[0], kv[1], 0, SCALE, unfused)
        out = attend_step(q[None], kv[0][None], kv[1][None], 0, SCALE, meta)
    assert torch.equal(out[0], expected)
    assert unfused.kv_cache is not None and torch.equal(pool, unfused.kv_cache)


def test_the_kernel_refuses_a_pool_of_the_wrong_width() -> None:
    needs_kernel()
    pool, q, _, meta = mixed_step([5, 20], [], torch.float32, True, True)
    narrow = pool[..., :HEAD_DIM].contiguous()  # int8 without room for the scale
    with pytest.raises(RuntimeError, match="head_dim"):
        torch.ops.pagedserve_cpu.paged_decode(q.transpose(0, 1).contiguous(), narrow[0, 0],
                                              narrow[0, 1], meta.decode_tables,
                                              meta.decode_lens, SCALE)


# ----------------------------------------------------------------------------- the pool


@pytest.fixture(scope="module")
def int8_runner(tiny_llama: Path) -> ModelRunner:
    return loaded_runner(tiny_config(tiny_llama, kv_cache_dtype="int8", num_kv_blocks=None,
                                     kv_cache_memory=1 << 20))


def test_the_runner_allocates_int8_rows_under_the_budget(int8_runner: ModelRunner) -> None:
    f = int8_runner.facts
    assert int8_runner.kv_cache.dtype == torch.int8
    assert int8_runner.kv_cache.shape[-1] == f.head_dim + kv_int8.SCALE_BYTES
    row_bytes = f.num_layers * 2 * f.num_kv_heads * (f.head_dim + 2)  # one token, all layers
    assert int8_runner.num_kv_blocks == (1 << 20) // (row_bytes * int8_runner.block_size)
    assert int8_runner.kv_cache.untyped_storage().nbytes() <= 1 << 20
    assert int8_runner.memory.kv_pool == int8_runner.kv_cache.untyped_storage().nbytes()
    # At the head dims people serve, against bfloat16 rows: 128 / 66 and 256 / 130.
    for head_dim in (64, 128):
        assert 2 * head_dim / kv_int8.row_width(head_dim, int8=True) >= 1.9


def test_the_flag_and_its_refusal() -> None:
    from api.cli import build_parser, config_overrides
    from engine.config import EngineConfig

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert config_overrides(args)["kv_cache_dtype"] == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")


def test_preemption_prefix_hits_chunks_and_drafts_over_an_int8_pool(
        int8_runner: ModelRunner, llama_runner: ModelRunner) -> None:
    """The scheduler's paths over an int8 pool, end to end on the tiny model: a pool too
    small for the batch (preemption), a shared prefix (cache hits), prompts cut into chunks,
    n-gram drafts. Every request finishes with its tokens, every block comes back; and a
    prompt computed in one step gives the float pool's first token exactly (it attends over
    its own K/V as computed: the pool is only read from the next step on)."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from scheduler.config import SchedulerConfig
    from scheduler.sampling_params import SamplingParams
    from tests.engine.test_golden import run

    prefix = [(5 * i) % 200 + 3 for i in range(24)]
    prompts = {f"r{i}": prefix + [(11 * i + j) % 250 + 3 for j in range(4 + 3 * i)]
               for i in range(6)}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    speculative = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
                   '"prompt_lookup_max": 3}')

    def engine(runner: ModelRunner, blocks: int | None, **sched: object) -> LLMEngine:
        cfg = EngineConfig(model=None, dtype="float32", device="cpu", enforce_eager=True,
                           num_kv_blocks=blocks, kv_cache_dtype=runner.config.kv_cache_dtype,
                           scheduler=SchedulerConfig(block_size=runner.block_size,
                                                     **sched))  # type: ignore[arg-type]
        built = LLMEngine(cfg, runner=runner)
        built.load()
        return built

    whole = run(engine(int8_runner, None, max_num_batched_tokens=256), prompts, params)
    floats = run(engine(llama_runner, None, max_num_batched_tokens=256), prompts, params)
    assert {r: t[0] for r, t in whole.items()} == {r: t[0] for r, t in floats.items()}
    for blocks, sched in ((24, {"max_num_batched_tokens": 256}),  # preempts
                          (None, {"max_num_batched_tokens": 16}),  # chunks
                          (None, {"max_num_batched_tokens": 64,
                                  "speculative_config": speculative})):
        eng = engine(int8_runner, blocks, **sched)
        out = run(eng, prompts, params)  # asserts every block is free afterwards
        assert all(len(t) == 12 for t in out.values()), sched
        assert eng.stats().prefix_cache_hits > 0
        if blocks:
            assert eng.stats().num_preemptions > 0
