"""HF baselines on a tiny random Llama built in-process (no weights downloaded)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# benchmarks/ is not an installed package (pyproject installs engine, api, scheduler only).
from benchmarks.hf_baseline import decode_ms_per_token, run_one_at_a_time, run_static_batches

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18], [19, 20]]
MAX_NEW = [4, 7, 2, 5, 3]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    # Make EOS the token greedy decoding picks after the first prompt: without
    # min_new_tokens that request would stop after one token.
    with torch.inference_mode():
        first = int(model(torch.tensor([PROMPTS[0]])).logits[0, -1].argmax())
    model.generation_config.eos_token_id = first
    return model


@pytest.fixture(scope="module")
def single(model: LlamaForCausalLM) -> dict[str, Any]:
    return run_one_at_a_time(model, None, PROMPTS, MAX_NEW, warmup=False)


def test_one_at_a_time_gives_every_request_its_length(model: LlamaForCausalLM,
                                                      single: dict[str, Any]) -> None:
    assert [len(o) for o in single["outputs"]] == MAX_NEW
    assert single["output_tokens"] == single["generated_tokens"] == sum(MAX_NEW)
    assert single["tok_per_s"] == pytest.approx(single["output_tokens"] / single["wall_s"])
    # EOS was the greedy first token of request 0; min_new_tokens kept it from ending early.
    assert single["outputs"][0][0] != model.generation_config.eos_token_id


def test_static_batches_match_single_requests(model: LlamaForCausalLM,
                                              single: dict[str, Any]) -> None:
    static = run_static_batches(model, PROMPTS, MAX_NEW, batch_size=2)
    # Left padding under the attention mask does not change greedy tokens.
    assert static["outputs"] == single["outputs"]
    assert static["output_tokens"] == sum(MAX_NEW)
    # Batches [4, 7], [2, 5], [3]: each runs to its longest request.
    assert static["generated_tokens"] == 2 * 7 + 2 * 5 + 3
    assert static["batch_size"] == 2 and static["num_requests"] == len(PROMPTS)


def test_rejects_bad_workload(model: LlamaForCausalLM) -> None:
    with pytest.raises(ValueError, match="as many"):
        run_one_at_a_time(model, None, PROMPTS, MAX_NEW[:-1])
    with pytest.raises(ValueError, match="batch_size"):
        run_static_batches(model, PROMPTS, MAX_NEW, batch_size=0)


def test_decode_ms_per_token_takes_the_prefill_out(model: LlamaForCausalLM) -> None:
    out = decode_ms_per_token(model, PROMPTS[:2], 6)
    assert out["num_requests"] == 2 and out["new_tokens"] == 6 and len(out["per_request_ms"]) == 2
    assert out["ms_per_token"] == pytest.approx(sum(out["per_request_ms"]) / 2)  # median of 2
    assert out["first_token_ms"] > 0
    with pytest.raises(ValueError, match="new_tokens must be >= 2"):
        decode_ms_per_token(model, PROMPTS[:1], 1)
