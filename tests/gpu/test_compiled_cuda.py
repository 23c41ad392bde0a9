"""The compiled step on CUDA (skipped without a GPU; CI has none): the same code path as on
the CPU, compiled vs eager logits on the real SmolLM2 in float32 over prefill, mixed and
decode-only steps (bucketed, padded), then greedy tokens of both through the whole engine."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from tests.engine.test_compiled import run_lockstep

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was",
           "1, 2, 3, 4, 5,", "Water boils at", "The three primary colors are red,"]


def config(eager: bool) -> EngineConfig:
    return EngineConfig(model=None, dtype="float32", device="cuda", num_kv_blocks=512,
                        enforce_eager=eager,
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                  block_size=16))


def test_compiled_logits_match_eager_on_cuda() -> None:
    runners = []
    for eager in (True, False):
        runner = ModelRunner(config(eager))
        runner.load()
        runners.append(runner)
    assert runners[1].compiled is not None
    # TF32 is off by default for matmuls, so fp32 stays close; SmolLM2 logits are ~10-30.
    assert run_lockstep(runners[0], runners[1]) < 1e-2


def greedy(eager: bool) -> dict[str, list[int]]:
    engine = LLMEngine(config(eager))
    engine.load()
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for i, text in enumerate(PROMPTS):
        engine.add_request(f"p{i}", engine.tokenizer.encode(text), params)
    out: dict[str, list[int]] = {f"p{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def test_compiled_greedy_tokens_equal_eager_on_cuda() -> None:
    assert greedy(eager=False) == greedy(eager=True)
