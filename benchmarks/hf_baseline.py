"""Hugging Face transformers baselines on the benchmark workload (token-id prompts).

Both runners decode greedily with `min_new_tokens == max_new_tokens`, so EOS never ends a
request early and every request produces exactly its own output length, like our engine
run with `ignore_eos`. Output tokens/s counts only the tokens each request asked for.

- `run_one_at_a_time`: one `model.generate()` per request (no batching at all).
- `run_static_batches`: left-padded batches with an attention mask; a batch runs until its
  longest request is done, so shorter requests' extra tokens are computed and discarded
  (the waste continuous batching removes).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from tqdm import tqdm

WARMUP_TOKENS = 2  # one short generate() before timing: first-call allocations are not counted


def run_one_at_a_time(model: Any, tokenizer: Any | None, prompts: list[list[int]],
                      max_new_tokens: list[int], warmup: bool = True) -> dict[str, Any]:
    """Each request alone through `model.generate()`; returns outputs, wall_s, tok_per_s."""
    _check_workload(prompts, max_new_tokens)
    pad_id = _pad_token_id(model, tokenizer)
    if warmup:
        _generate(model, [prompts[0]], WARMUP_TOKENS, pad_id)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for prompt, n in tqdm(list(zip(prompts, max_new_tokens)), desc="hf one-at-a-time",
                          unit="req"):
        outputs.extend(_generate(model, [prompt], n, pad_id))
    wall = time.perf_counter() - start
    return _result(outputs, max_new_tokens, wall, generated_tokens=sum(max_new_tokens))


def run_static_batches(model: Any, prompts: list[list[int]], max_new_tokens: list[int],
                       batch_size: int, warmup: bool = True) -> dict[str, Any]:
    """Requests in arrival order, `batch_size` at a time, each batch run to its longest output."""
    _check_workload(prompts, max_new_tokens)
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    pad_id = _pad_token_id(model, None)
    if warmup:
        _generate(model, prompts[:batch_size], WARMUP_TOKENS, pad_id)
    outputs: list[list[int]] = []
    generated = 0  # tokens computed, counting the ones thrown away
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc="hf static batches", unit="batch"):
        wants = max_new_tokens[i:i + batch_size]
        batch_out = _generate(model, prompts[i:i + batch_size], max(wants), pad_id)
        outputs.extend(out[:n] for out, n in zip(batch_out, wants))
        generated += max(wants) * len(wants)
    wall = time.perf_counter() - start
    result = _result(outputs, max_new_tokens, wall, generated_tokens=generated)
    result["batch_size"] = batch_size
    return result


def decode_ms_per_token(model: Any, prompts: list[list[int]], new_tokens: int,
                        warmup: bool = True) -> dict[str, Any]:
    """Hugging Face's per-token decode time, one request at a time: for each prompt,
    (time of a `new_tokens` generate() - time of a 1-token generate()) / (new_tokens - 1),
    so the prompt's prefill is taken out and the number compares with a server's ITL.
    -> ms_per_token (the median over prompts), per_request_ms, first_token_ms (median)."""
    _check_workload(prompts, [new_tokens] * len(prompts))
    if new_tokens < 2:
        raise ValueError("new_tokens must be >= 2 to time a decode step")
    pad_id = _pad_token_id(model, None)
    if warmup:
        _generate(model, [prompts[0]], WARMUP_TOKENS, pad_id)
    per_token, first = [], []
    for prompt in tqdm(prompts, desc="hf generate() ms/token", unit="req"):
        t0 = time.perf_counter()
        _generate(model, [prompt], 1, pad_id)
        t1 = time.perf_counter()
        _generate(model, [prompt], new_tokens, pad_id)
        t2 = time.perf_counter()
        first.append((t1 - t0) * 1000)
        per_token.append(((t2 - t1) - (t1 - t0)) * 1000 / (new_tokens - 1))
    return {"ms_per_token": statistics.median(per_token), "per_request_ms": per_token,
            "first_token_ms": statistics.median(first), "num_requests": len(prompts),
            "new_tokens": new_tokens}


@torch.inference_mode()
def _generate(model: Any, prompts: list[list[int]], n: int, pad_id: int) -> list[list[int]]:
    """Greedy, exactly n new tokens for every prompt (left-padded together)."""
    input_ids, mask = _left_pad(prompts, pad_id, model.device)
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=pad_id)
    new = out[:, input_ids.shape[1]:]  # [batch, n]
    assert new.shape[1] == n, f"generate() returned {new.shape[1]} tokens, asked for {n}"
    return new.tolist()


def _left_pad(prompts: list[list[int]], pad_id: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, longest] ids and mask, padding on the left so every prompt ends at the edge."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _pad_token_id(model: Any, tokenizer: Any | None) -> int:
    """Any id works under a zero mask; prefer the tokenizer's pad, then the model's eos."""
    for source in (tokenizer, getattr(model, "generation_config", None), model.config):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, int):
                return value
    return 0


def _check_workload(prompts: list[list[int]], max_new_tokens: list[int]) -> None:
    if not prompts or len(prompts) != len(max_new_tokens):
        raise ValueError("need as many max_new_tokens as prompts, and at least one prompt")
    if any(not p for p in prompts) or any(n < 1 for n in max_new_tokens):
        raise ValueError("prompts must be non-empty and max_new_tokens >= 1")


def _result(outputs: list[list[int]], max_new_tokens: list[int], wall: float,
            generated_tokens: int) -> dict[str, Any]:
    useful = sum(len(o) for o in outputs)
    assert useful == sum(max_new_tokens), "a request got fewer tokens than it asked for"
    return {"num_requests": len(outputs), "outputs": outputs, "output_tokens": useful,
            "generated_tokens": generated_tokens, "wall_s": wall,
            "tok_per_s": useful / wall if wall > 0 else float("inf")}
