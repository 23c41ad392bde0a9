"""ModelRunner against Hugging Face: tiny random models (fast) and the real SmolLM2 (slow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.worker import model_runner
from engine.worker.model_runner import ModelRunner
from scheduler.output import SchedulerOutput
from scheduler.sequence import Sequence
from tests.support.models import drive, greedy_seq, loaded_runner, tiny_config

PROMPTS = [[5, 9, 13, 200, 17], [42] * 3 + list(range(60, 90)), list(range(100, 113)), [7]]


def reference_model(folder: Path | str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def assert_close_to_hf(ref: torch.nn.Module, seq: Sequence) -> None:
    """Teacher-forced on our own tokens: each must be HF's argmax or (a near tie) its top-2."""
    with torch.inference_mode():
        logits = ref(torch.tensor([seq.token_ids])).logits[0]  # [L, V]
    top2 = logits[seq.num_prompt_tokens - 1:-1].topk(2, dim=-1).indices  # [out, 2]
    ours = torch.tensor(seq.output_token_ids)[:, None]
    assert (top2 == ours).any(dim=1).all(), (seq.seq_id, top2.tolist(), seq.output_token_ids)
    assert (top2[:, 0] == ours[:, 0]).float().mean() >= 0.9


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("chunk", [3, 64])
def test_tiny_models_match_hf(arch: str, chunk: int, request: pytest.FixtureRequest) -> None:
    runner: ModelRunner = request.getfixturevalue(f"{arch}_runner")
    folder = request.getfixturevalue(f"tiny_{arch}")
    seqs = [greedy_seq(f"s{i}", p, 12) for i, p in enumerate(PROMPTS)]
    drive(runner, seqs, chunk=chunk, start_step=[0, 2, 2, 5])  # staggered: mixed steps
    ref = reference_model(folder)
    for seq in seqs:
        assert seq.num_output_tokens == 12
        assert_close_to_hf(ref, seq)


def test_samples_exactly_the_sequences_that_finish_their_tokens(llama_runner: ModelRunner) -> None:
    seen: list[tuple[set[str], set[str]]] = []

    def check(batch: SchedulerOutput, out: object) -> None:
        want = {s.seq_id for i, s in enumerate(batch.seqs) if batch.samples(i)}
        seen.append((want, set(out.sampled_token_ids)))  # type: ignore[attr-defined]

    seqs = [greedy_seq("a", PROMPTS[1], 3), greedy_seq("b", PROMPTS[0], 3)]
    drive(llama_runner, seqs, chunk=4, on_output=check)
    assert all(want == got for want, got in seen)
    assert any(not want for want, _ in seen)  # a prefill-only step sampled nothing


def test_logits_go_to_the_sampler_uncopied_only_when_every_row_samples(
        llama_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """samples_every_row skips the [S, V] index_select: right only when the sampled rows are
    exactly the kept rows in order (decode-only steps), not when prompt-logprob rows are kept
    too. The tokens stay HF's either way (test_tiny_models_match_hf, the golden tests)."""
    flags: list[bool] = []
    prepare = llama_runner._prepare

    def spy(*args: object, **kwargs: object) -> object:
        step = prepare(*args, **kwargs)  # type: ignore[arg-type]
        if step.sample_rows is not None:
            in_order = torch.equal(step.sample_rows, torch.arange(step.keep.shape[0]))
            assert step.samples_every_row == in_order
            flags.append(step.samples_every_row)
        return step

    monkeypatch.setattr(llama_runner, "_prepare", spy)
    seqs = [greedy_seq("p", PROMPTS[1], 3, prompt_logprobs=1), greedy_seq("d", PROMPTS[0], 3)]
    drive(llama_runner, seqs, chunk=64)
    assert True in flags and False in flags


def test_empty_batch(llama_runner: ModelRunner) -> None:
    out = llama_runner.execute(SchedulerOutput())
    assert not out.sampled_token_ids and not out.prompt_logprobs


def test_prompt_logprobs_match_hf_log_softmax(llama_runner: ModelRunner, tiny_llama: Path) -> None:
    prompt = PROMPTS[1]
    got: list = []
    seq = greedy_seq("p", prompt, 2, prompt_logprobs=3)
    drive(llama_runner, [seq], chunk=5,
          on_output=lambda b, o: got.extend(o.prompt_logprobs.get("p", [])))  # type: ignore
    with torch.inference_mode():
        logits = reference_model(tiny_llama)(torch.tensor([prompt])).logits[0]
    ref = torch.log_softmax(logits[:-1], dim=-1)
    assert [lp.token_id for lp in got] == prompt[1:]
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got]), want,
                               atol=1e-4, rtol=1e-4)
    assert list(got[0].top_ids) == ref[0].topk(3).indices.tolist()


def test_prompt_logprobs_not_repeated_after_recompute(llama_runner: ModelRunner) -> None:
    got: list = []
    seq = greedy_seq("r", PROMPTS[2], 1, prompt_logprobs=0)
    drive(llama_runner, [seq], chunk=4,
          on_output=lambda b, o: got.extend(o.prompt_logprobs.get("r", [])))  # type: ignore
    seq.num_computed_tokens, seq.block_table = 0, []  # preempted: recompute from scratch
    seq.params = seq.params.__class__(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    drive(llama_runner, [seq], chunk=64,
          on_output=lambda b, o: got.extend(o.prompt_logprobs.get("r", [])))  # type: ignore
    assert len(got) == len(PROMPTS[2]) - 1
    assert [lp.token_id for lp in got] == PROMPTS[2][1:]  # each position once, in order
    # The runner keeps no per-request state: a new request under the same id is owed
    # every position again, and there is nothing to release between the two.
    again: list = []
    drive(llama_runner, [greedy_seq("r", PROMPTS[2], 1, prompt_logprobs=0)], chunk=5,
          on_output=lambda b, o: again.extend(o.prompt_logprobs.get("r", [])))  # type: ignore
    assert [lp.token_id for lp in again] == PROMPTS[2][1:]
    assert not hasattr(llama_runner, "release")


def test_worst_decode_step_runs_grouped(llama_runner: ModelRunner,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The step CUDA profiling sizes the pool by: max_num_seqs decodes at max_model_len (8 x
    256 here) plus a prefill; on a one-block scratch pool and on the real one. A budget of one
    sequence's K/V forces a group per decode."""
    from engine.attention import paged as attention

    groups: list[int] = []
    build = attention.build_metadata

    def spy(*args: object, **kwargs: object) -> attention.AttentionMetadata:
        meta = build(*args, **kwargs)  # type: ignore[arg-type]
        groups.append(len(meta.decode_groups))
        return meta

    monkeypatch.setattr("engine.worker.model_runner.build_metadata", spy)
    monkeypatch.setattr(llama_runner, "paged_decode_kernel", False)  # the torch path groups
    one_seq = 2 * 2 * 256 * 16 * 4  # K + V, kvH, tokens, hd, fp32
    monkeypatch.setitem(attention.DECODE_GATHER_BYTES, "cpu", one_seq)
    llama_runner._worst_decode_step()
    llama_runner._worst_decode_step(llama_runner.kv_cache)
    assert groups == [8, 8]


def test_worst_prefill_keeps_and_scores_every_row(llama_runner: ModelRunner,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31: a prompt_logprobs step keeps every prompt row's logits and takes their
    float32 log-softmax, but the CUDA profile kept max_num_seqs rows, so several long echo
    requests could take memory the KV pool had been given. The profile's worst prefill now
    keeps (and scores) the whole token budget, the most a real step keeps."""
    kept: list[int] = []
    scored: list[int] = []
    forward, score = llama_runner._forward, model_runner.compute_prompt_logprobs

    def spy_forward(*args: Any) -> torch.Tensor:
        kept.append(int(args[3].numel()))
        return forward(*args)

    def spy_score(logits: torch.Tensor, *args: Any) -> Any:
        scored.append(logits.shape[0])
        return score(logits, *args)

    monkeypatch.setattr(llama_runner, "_forward", spy_forward)
    monkeypatch.setattr(model_runner, "compute_prompt_logprobs", spy_score)
    llama_runner._worst_prefill()
    budget = llama_runner.config.scheduler.max_num_batched_tokens
    assert budget > llama_runner.config.scheduler.max_num_seqs
    assert kept == [budget] and scored == [budget]


def test_runner_facts_and_kv_pool(llama_runner: ModelRunner) -> None:
    r = llama_runner
    assert r.num_kv_blocks == 128 and r.block_size == 4
    assert r.kv_cache.shape == (2, 2, 128, 2, 4, 16)  # layers, K/V, blocks, kvH, block, hd
    assert r.max_model_len == 256  # min(scheduler 256, model 512)
    assert r.eos_token_ids == frozenset({1})
    assert r.vocab_size == len(r.tokenizer)
    assert r.device == torch.device("cpu") and r.dtype == torch.float32


def test_kv_pool_sized_from_memory_budget(tiny_llama: Path) -> None:
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # layers * K/V * block * kvH * hd * fp32
    runner = loaded_runner(tiny_config(tiny_llama, num_kv_blocks=None,
                                       kv_cache_memory=10 * block_bytes + 7))
    assert runner.num_kv_blocks == 10


def test_bfloat16_runs(tiny_llama: Path) -> None:
    runner = loaded_runner(tiny_config(tiny_llama, dtype="bfloat16"))
    seqs = [greedy_seq(f"b{i}", p, 4) for i, p in enumerate(PROMPTS)]
    drive(runner, seqs, chunk=8)
    assert runner.kv_cache.dtype == torch.bfloat16
    assert all(s.num_output_tokens == 4 for s in seqs)


# ----------------------------------------------------------------------------- real model


CHATS = ["What is the capital of France?", "Write a haiku about the ocean.",
         "Explain in two sentences why the sky is blue."]


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [7, 256])
def test_smollm2_matches_hf_generate_token_for_token(smollm2_runner: ModelRunner,
                                                     chunk: int) -> None:
    runner, new = smollm2_runner, 20
    tok = runner.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=True,
                                       add_generation_prompt=True) for c in CHATS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    seqs = [greedy_seq(f"c{i}", p, new) for i, p in enumerate(prompts)]
    drive(runner, seqs, chunk=chunk, start_step=[0, 3, 9])
    for seq in seqs:
        want = hf_greedy(runner, seq.prompt_token_ids, new)  # may stop early at EOS
        assert len(want) >= 5 and seq.output_token_ids[:len(want)] == want, seq.seq_id


_REF: dict[tuple[int, ...], list[int]] = {}


def hf_greedy(runner: ModelRunner, prompt: list[int], new: int) -> list[int]:
    """HF generate() with its own model (sdpa attention) from the same converted folder;
    memoised so the parametrised cases share it."""
    key = (*prompt, -new)
    if key not in _REF:
        from engine.worker.loader import converted_gguf, embedded_gguf

        if "model" not in _MODEL:
            _MODEL["model"] = reference_model(converted_gguf(embedded_gguf()))
        with torch.inference_mode():
            out = _MODEL["model"].generate(  # type: ignore[operator]
                torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
        _REF[key] = out[0, len(prompt):].tolist()
    return _REF[key]


_MODEL: dict[str, torch.nn.Module] = {}


def test_verify_keeps_drafts_while_they_are_the_tokens_drawn() -> None:
    from engine.worker.model_runner import _positions, verify

    assert verify([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept, then the bonus token
    assert verify([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the draw at the first miss replaces it
    assert verify([5], [4, 4]) == [4]
    # rows of batch entries 0 (alone), 1 (three positions) and 3 (two): their positions
    assert _positions([0, 1, 1, 1, 3, 3]) == [0, 0, 1, 2, 0, 1]


def test_a_drafting_rows_seeded_uniforms_are_those_of_its_positions() -> None:
    import torch

    from engine.sample.sampling_batch import SamplingBatchBuilder, seeded_uniform
    from scheduler.sampling_params import SamplingParams
    from scheduler.sequence import Sequence

    seq = Sequence("a", [1, 2, 3], SamplingParams(temperature=1.0, seed=7))
    seq.append_token(4)  # one output token so far
    batch = SamplingBatchBuilder(10).build([seq] * 3, torch.device("cpu"), offsets=[0, 1, 2])
    assert batch.uniforms is not None
    assert batch.uniforms.tolist() == pytest.approx([seeded_uniform(7, p) for p in (1, 2, 3)])
