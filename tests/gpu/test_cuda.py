"""CUDA checks (skipped without a GPU; CI has none): the same engine on the GPU, greedy tokens
against HF generate() on the same device, in float32 (top-2 tolerance: GPU kernels pick
different but equally valid reduction orders for a packed batch), a bfloat16 smoke run, and
the KV pool sizing against the worst decode step (eager, as the sizing runs). The engine
runs compiled here, the default; tests/gpu/test_compiled_cuda.py compares it with eager."""

from __future__ import annotations

import pytest
import torch

from engine.attention import paged as attention
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.worker.loader import load_model
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was",
           "1, 2, 3, 4, 5,", "Water boils at", "The three primary colors are red,"]


def run_engine(dtype: str, max_tokens: int) -> tuple[LLMEngine, dict[str, list[int]], dict]:
    cfg = EngineConfig(model=None, dtype=dtype, device="cuda", num_kv_blocks=512,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    engine = LLMEngine(cfg)
    engine.load()
    prompts = {f"p{i}": engine.tokenizer.encode(t) for i, t in enumerate(PROMPTS)}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    return engine, out, prompts


def test_float32_greedy_within_hf_top2() -> None:
    _, ours, prompts = run_engine("float32", 16)
    hf = load_model(None, device="cuda", dtype="float32").model
    for rid, ids in prompts.items():
        seq = list(ids)
        for t in ours[rid]:
            with torch.inference_mode():
                logits = hf(torch.tensor([seq], device="cuda")).logits[0, -1]
            assert t in torch.topk(logits, 2).indices.tolist()
            seq.append(t)


def test_bfloat16_runs_and_frees_blocks() -> None:
    engine, ours, _ = run_engine("bfloat16", 32)
    assert engine.runner.dtype == torch.bfloat16
    assert all(len(v) > 0 for v in ours.values())


def test_sized_pool_leaves_room_for_the_worst_decode_step() -> None:
    """The pool sized from gpu_memory_utilization leaves the memory of the step with the
    largest decode gathers: max_num_seqs decodes at max_model_len (256 x 8192 of SmolLM2:
    1.5 GiB of K + V per layer unless grouped), here run on the real pool."""
    util = 0.5
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=512, max_model_len=8192)
    runner = ModelRunner(EngineConfig(model=None, dtype="bfloat16", device="cuda",
                                      gpu_memory_utilization=util, enforce_eager=True,
                                      scheduler=sched))
    runner.load()
    dev, f = runner.device, runner.facts
    assert runner.max_model_len == 8192
    ungrouped = 256 * 8192 * 2 * f.num_kv_heads * f.head_dim * 2  # tokens * K/V * kvH * hd * bf16
    assert ungrouped > 4 * attention.decode_gather_budget(dev)  # grouping is what keeps it in
    _, total = torch.cuda.mem_get_info(dev)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    runner._worst_decode_step(runner.kv_cache)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    assert peak <= total * util, (peak, total * util, runner.num_kv_blocks)
