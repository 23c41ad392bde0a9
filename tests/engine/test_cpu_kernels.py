"""The C++ paged-decode kernel (engine/attention/csrc/paged_decode.cpp) against the torch path, at the
real model's head shapes, and the loader's fallbacks. tests/engine/test_attention.py runs both
paths against dense SDPA (fp32, 1e-5); the golden tests run it inside the model."""

from __future__ import annotations

import dataclasses
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from api.cli import build_parser, config_overrides
from engine.attention import cpu_kernels, kv_int8
from engine.attention.paged import AttentionMetadata, attend, attend_step, build_metadata
from engine.attention.scores import ScoreRule
from engine.config import EngineConfig
from engine.worker.model_runner import ModelRunner

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not cpu_kernels.paged_decode_available():
        pytest.skip("the CPU paged-decode kernel did not build here (no g++?)")


def decode_step(contexts: list[int], dtype: torch.dtype, kernel: bool, seed: int = 0,
                pool: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                sinks: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One layer's decode step: a shuffled pool, one query per context. Returns the pool, the
    queries [H, D, hd], the new K/V [2, kvH, D, hd] and the metadata."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-c // BLOCK) for c in contexts)
    if pool is None:
        pool = torch.randn(1, 2, need + 3, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    blocks = list(range(pool.shape[2]))
    random.Random(seed).shuffle(blocks)
    tables, slots = [], []
    for c in contexts:
        table = [blocks.pop() for _ in range(-(-c // BLOCK))]
        tables.append(table)
        slots.append(table[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK)
    meta = build_metadata(pool, BLOCK, slots, list(zip(tables, contexts)), [],
                          torch.device("cpu"), paged_decode_kernel=kernel,
                          rules=(ScoreRule(window, softcap, SINKS if sinks else None),))
    q = torch.randn(HEADS, len(contexts), HEAD_DIM, generator=gen).to(dtype)
    kv = torch.randn(2, KV_HEADS, len(contexts), HEAD_DIM, generator=gen).to(dtype)
    return pool, q, kv, meta


def run(contexts: list[int], dtype: torch.dtype, kernel: bool, seed: int = 0,
        window: int = 0, softcap: float = 0.0, sinks: bool = False) -> torch.Tensor:
    _, q, kv, meta = decode_step(contexts, dtype, kernel, seed, window=window, softcap=softcap,
                                 sinks=sinks)
    with torch.inference_mode():
        return attend(q, kv[0], kv[1], 0, HEAD_DIM ** -0.5, meta)


def reference(contexts: list[int], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Float64 attention over the same (dtype-rounded) inputs, per sequence."""
    pool, q, kv, meta = decode_step(contexts, dtype, False, seed)
    assert meta.decode_groups
    with torch.inference_mode():
        attend(q, kv[0], kv[1], 0, 1.0, meta)  # writes the new K/V into the pool
    assert meta.decode_tables is None
    k_pool, v_pool = pool[0].double()
    outs = []
    for i, c in enumerate(contexts):
        rows = [b for b in _table(meta, i)][:-(-c // BLOCK)]
        k = k_pool[rows].transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM)[:, :c]
        v = v_pool[rows].transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM)[:, :c]
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
        scores = (q[:, i:i + 1].double() @ k.transpose(1, 2)) * HEAD_DIM ** -0.5
        outs.append((scores.softmax(-1) @ v)[:, 0])
    return torch.stack(outs)  # [D, H, hd]


def _table(meta: AttentionMetadata, i: int) -> list[int]:
    """Sequence i's blocks, recovered from its decode group's pool rows."""
    for g in meta.decode_groups:
        if g.start <= i < g.end:
            rows = g.rows.view(g.end - g.start, KV_HEADS, -1)[i - g.start, 0]
            return (rows // KV_HEADS).tolist()
    raise AssertionError(i)


CONTEXTS = [1, 15, 16, 17, 100, 333, 40, 2]  # block edges, a single token, long and short


def test_float32_matches_the_torch_path() -> None:
    torch.testing.assert_close(run(CONTEXTS, torch.float32, True),
                               run(CONTEXTS, torch.float32, False), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 16, 40, 1000])
def test_a_sliding_window_matches_the_torch_path(window: int) -> None:
    """issue 33: a sliding-window layer's decodes through the kernel (the window's first
    block is read whole, its rows before the window weigh 0), unfused and fused."""
    torch.testing.assert_close(run(CONTEXTS, torch.float32, True, window=window),
                               run(CONTEXTS, torch.float32, False, window=window),
                               atol=1e-5, rtol=1e-5)
    if window < max(CONTEXTS):  # the window changes the answer
        assert not torch.allclose(run(CONTEXTS, torch.float32, True, window=window),
                                  run(CONTEXTS, torch.float32, True), atol=1e-3)
    _, q, kv, meta = decode_step(CONTEXTS, torch.float32, True, window=window)
    assert meta.fused_step
    with torch.inference_mode():
        fused = attend_step(q[None], kv[0][None], kv[1][None], 0, HEAD_DIM ** -0.5, meta)
    torch.testing.assert_close(fused[0], run(CONTEXTS, torch.float32, False, window=window),
                               atol=1e-5, rtol=1e-5)


SINKS = torch.linspace(-2.0, 3.0, HEADS)  # gpt-oss's per-head sink logits


@pytest.mark.parametrize("window, softcap, sinks", [(0, 0.5, False), (7, 0.5, False),
                                                    (0, 0.0, True), (7, 0.5, True)])
def test_a_soft_cap_and_sinks_match_the_torch_path(window: int, softcap: float,
                                                   sinks: bool) -> None:
    """Gemma 2's attention soft cap (scores -> cap * tanh(score / cap)) and gpt-oss's sinks
    (one more logit per head in the softmax's sum), with and without a window, unfused and
    fused."""
    want = run(CONTEXTS, torch.float32, False, window=window, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(
        run(CONTEXTS, torch.float32, True, window=window, softcap=softcap, sinks=sinks),
        want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, run(CONTEXTS, torch.float32, False, window=window),
                              atol=1e-3)
    _, q, kv, meta = decode_step(CONTEXTS, torch.float32, True, window=window, softcap=softcap,
                                 sinks=sinks)
    with torch.inference_mode():
        fused = attend_step(q[None], kv[0][None], kv[1][None], 0, HEAD_DIM ** -0.5, meta)
    torch.testing.assert_close(fused[0], want, atol=1e-5, rtol=1e-5)


def test_bfloat16_is_at_least_as_close_to_float64_as_the_torch_path() -> None:
    """The torch path rounds the probabilities to bf16 before P @ V; the kernel keeps fp32."""
    ref = reference(CONTEXTS, 0, torch.bfloat16)
    kernel_err = (run(CONTEXTS, torch.bfloat16, True).double() - ref).abs().max().item()
    torch_err = (run(CONTEXTS, torch.bfloat16, False).double() - ref).abs().max().item()
    assert kernel_err <= torch_err, (kernel_err, torch_err)
    assert kernel_err < 1e-2


def test_a_sequence_gets_the_same_bits_alone_in_a_batch_and_on_any_thread_count() -> None:
    """Each (sequence, kv head) is one sequential task: nothing in its arithmetic depends on
    the rest of the step or on how the tasks are spread over threads."""
    contexts = [333, 5, 90, 17, 250, 64, 1, 128, 31, 200, 77, 160]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = run(contexts, torch.bfloat16, True)
        torch.set_num_threads(1)
        assert torch.equal(run(contexts, torch.bfloat16, True), batch)
    finally:
        torch.set_num_threads(threads)
    pool, q, kv, meta = decode_step(contexts, torch.bfloat16, True)
    with torch.inference_mode():
        attend(q, kv[0], kv[1], 0, HEAD_DIM ** -0.5, meta)  # the pool now holds the new K/V
        for i in (0, 6, 11):
            assert meta.decode_tables is not None and meta.decode_lens is not None
            alone = torch.ops.pagedserve_cpu.paged_decode(
                q[:, i:i + 1].transpose(0, 1).contiguous(), pool[0, 0], pool[0, 1],
                meta.decode_tables[i:i + 1], meta.decode_lens[i:i + 1], HEAD_DIM ** -0.5)
            assert torch.equal(alone[0], batch[i])


def test_bad_tables_raise_instead_of_reading_outside_the_pool() -> None:
    pool = torch.zeros(4, KV_HEADS, BLOCK, HEAD_DIM)
    q = torch.zeros(1, HEADS, HEAD_DIM)
    op = torch.ops.pagedserve_cpu.paged_decode
    for table, length, message in (([[4]], 3, "block index"), ([[-1]], 3, "block index"),
                                   ([[0]], 17, "context length"), ([[0]], 0, "context length")):
        with pytest.raises(RuntimeError, match=message):
            op(q, pool, pool, torch.tensor(table), torch.tensor([length]), 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(q.half(), pool.half(), pool.half(), torch.tensor([[0]]), torch.tensor([1]), 1.0)


def padded(x: torch.Tensor, pad: int, token_major: bool) -> torch.Tensor:
    """[heads, D, hd] -> [1, heads, D + pad, hd] with pad zero tokens; token_major: strided as
    HF's projections leave it (a [1, T, heads, hd] tensor transposed), else contiguous."""
    x = torch.cat([x, x.new_zeros(x.shape[0], pad, x.shape[2])], dim=1)[None]
    return x.transpose(1, 2).contiguous().transpose(1, 2) if token_major else x.contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad,token_major", [(0, True), (3, False), (2, True)])
def test_the_fused_step_writes_and_attends_as_the_unfused_path(dtype: torch.dtype, pad: int,
                                                               token_major: bool) -> None:
    """pagedserve_cpu::paged_decode_step (one call per layer of a decode-only step) against
    attend(): the same pool afterwards and the same output bits, zeros in the padding rows,
    whatever the query's layout."""
    pool, q, kv, meta = decode_step(CONTEXTS, dtype, True)
    assert meta.fused_step
    pool_unfused = pool.clone()
    meta_unfused = AttentionMetadata(pool_unfused, meta.write_blocks, meta.write_offsets,
                                     meta.num_decodes, (), (), BLOCK,
                                     decode_tables=meta.decode_tables,
                                     decode_lens=meta.decode_lens)
    assert not meta_unfused.fused_step
    scale = HEAD_DIM ** -0.5
    with torch.inference_mode():
        expected = attend(q, kv[0], kv[1], 0, scale, meta_unfused)  # [D, H, hd]
        out = attend_step(padded(q, pad, token_major), padded(kv[0], pad, token_major),
                          padded(kv[1], pad, not token_major), 0, scale, meta)
    assert out.shape == (1, len(CONTEXTS) + pad, HEADS, HEAD_DIM)
    assert torch.equal(out[0, :len(CONTEXTS)], expected)
    assert not out[0, len(CONTEXTS):].any()
    assert torch.equal(pool, pool_unfused)


def mixed_step(decodes: list[int], prefills: list[tuple[int, int]], dtype: torch.dtype,
               seed: int = 0, kernel: bool = True, int8: bool = False,
               rule: ScoreRule | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One layer of a step with decodes (their context lengths) then prefill chunks (n new
    tokens after c cached ones), in the runner's packed order, through the kernel path (or
    the torch path); int8: the pool's values as the int8 KV cache holds them; rule: the
    layer's ScoreRule. Returns the pool, q [1, H, T, hd], the new K/V [2, 1, kvH, T, hd] and
    the metadata."""
    gen = torch.Generator().manual_seed(seed)
    lengths = decodes + [c + n for n, c in prefills]
    pool = torch.randn(1, 2, sum(-(-n // BLOCK) for n in lengths) + 2, KV_HEADS, BLOCK,
                       HEAD_DIM, generator=gen).to(dtype)
    if int8:
        pool = kv_int8.quantize(pool)
    blocks = list(range(pool.shape[2]))
    random.Random(seed).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(-(-n // BLOCK))] for n in lengths]
    slots = [t[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK for t, c in zip(tables, decodes)]
    chunks, start = [], len(decodes)
    for (n, c), table in zip(prefills, tables[len(decodes):]):
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(c, c + n)]
        chunks.append((start, n, c, table))
        start += n
    meta = build_metadata(pool, BLOCK, slots, list(zip(tables, decodes)), chunks,
                          torch.device("cpu"), paged_decode_kernel=kernel,
                          rules=(rule,) if rule else ())
    q = torch.randn(1, HEADS, start, HEAD_DIM, generator=gen).to(dtype)
    kv = torch.randn(2, 1, KV_HEADS, start, HEAD_DIM, generator=gen).to(dtype)
    return pool, q, kv, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decodes,prefills", [
    ([5, 100, 17], [(40, 0), (7, 33)]),  # decodes, a fresh prompt, a chunk after 33 cached
    ([], [(30, 0)]),  # a prefill-only step: writes only, no tables
    ([64], [(1, 16)]),  # a one-token chunk on a block edge
])
def test_a_mixed_step_through_the_fused_op_equals_the_unfused_path(
        dtype: torch.dtype, decodes: list[int], prefills: list[tuple[int, int]]) -> None:
    """Decodes and prefill chunks in one step: the fused op writes every token's K/V and
    attends the decodes, SDPA the chunks; the same bits and the same pool as attend()."""
    pool, q, kv, meta = mixed_step(decodes, prefills, dtype)
    assert meta.fused_step and (meta.decode_tables is None) == (not decodes)
    pool_unfused = pool.clone()
    meta_unfused = dataclasses.replace(meta, kv_cache=pool_unfused, fused_step=False)
    scale = HEAD_DIM ** -0.5
    with torch.inference_mode():
        expected = attend(q[0], kv[0, 0], kv[1, 0], 0, scale, meta_unfused)  # [T, H, hd]
        pad = torch.zeros(1, HEADS, 3, HEAD_DIM, dtype=dtype)  # a compiled bucket's padding
        kv_pad = torch.zeros(1, KV_HEADS, 3, HEAD_DIM, dtype=dtype)
        out = attend_step(torch.cat([q, pad], 2), torch.cat([kv[0], kv_pad], 2),
                          torch.cat([kv[1], kv_pad], 2), 0, scale, meta)
    assert torch.equal(out[0, :q.shape[2]], expected)
    assert not out[0, q.shape[2]:].any()
    assert torch.equal(pool, pool_unfused)


def test_the_fused_step_checks_its_slots_and_layer() -> None:
    pool, q, kv, meta = decode_step([5, 20], torch.float32, True)
    op = torch.ops.pagedserve_cpu.paged_decode_step
    args = (q[None], kv[0][None], kv[1][None], pool)
    tables, lens = meta.decode_tables, meta.decode_lens
    full = pool.shape[2]
    for blocks, offsets, message in (([0, full], [0, 0], "write slot out of range"),
                                     ([0, 0], [0, BLOCK], "write slot out of range"),
                                     ([0, 0, 0], [0, 0], "one per new token")):
        with pytest.raises(RuntimeError, match=message):
            op(*args, 0, torch.tensor(blocks), torch.tensor(offsets), tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="layer out of range"):
        op(*args, 1, meta.write_blocks, meta.write_offsets, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="more decodes than new tokens"):
        op(*args, 0, meta.write_blocks[:1], meta.write_offsets[:1], tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="come together"):
        op(*args, 0, meta.write_blocks, meta.write_offsets, tables, None, 1.0)


def test_backend_choice() -> None:
    cpu = torch.device("cpu")
    assert cpu_kernels.wants_paged_decode("auto", cpu, torch.bfloat16)
    assert cpu_kernels.wants_paged_decode("auto", cpu, torch.float32)
    assert not cpu_kernels.wants_paged_decode("auto", cpu, torch.float16)
    assert not cpu_kernels.wants_paged_decode("auto", torch.device("cuda"), torch.bfloat16)
    assert not cpu_kernels.wants_paged_decode("torch", cpu, torch.float32)
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch"):
        EngineConfig(attention_backend="flash")


def test_the_flag_reaches_the_runner(llama_runner: ModelRunner) -> None:
    """The tiny test runner decodes through the kernel (auto); --attention-backend torch
    is an engine field the CLI fills."""
    assert llama_runner.paged_decode_kernel
    args = build_parser().parse_args(["serve", "--attention-backend", "torch"])
    assert config_overrides(args)["attention_backend"] == "torch"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-backend", "flash"])


def test_a_failed_build_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_kernels, "_loaded", {})  # as in a process that never loaded it
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))  # nothing cached: it must build
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    cpu_kernels.load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.attention.cpu_kernels"):
            assert not cpu_kernels.paged_decode_available()
            assert not cpu_kernels.wants_paged_decode("auto", torch.device("cpu"), torch.float32)
        assert len(caplog.records) == 1, caplog.records  # cached: asked twice, warned once
        assert "using the torch path: false failed" in caplog.records[0].message
    finally:
        cpu_kernels.load_library.cache_clear()  # the next caller finds the loaded library again


def test_loading_the_kernel_keeps_subnormals() -> None:
    """A library linked with -ffast-math turns on flush-to-zero for the whole process when it
    loads; ours is compiled with it but linked without. Checked in a fresh process, after the
    load, in Python floats (SSE doubles) and in torch."""
    script = ("import torch; from engine.attention import cpu_kernels as c; assert c.paged_decode_available();"
              "x = float.fromhex('0x1p-1070'); assert x * 1.0 > 0, 'DAZ/FTZ on';"
              "t = torch.tensor([1e-40]) * 2; assert t.item() > 0, 'torch flushes';print('ok')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120, check=False)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_cached_build_is_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    first = cpu_kernels._build(cpu_kernels.SOURCE, "kernel")

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert cpu_kernels._build(cpu_kernels.SOURCE, "kernel") == first
    assert first.name.startswith("paged_decode-") and first.suffix == ".so"
