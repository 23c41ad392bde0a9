"""LLMEngine behaviour on a tiny real model: prompt logprobs across chunks and preemption,
stop strings and stop token ids, max_tokens=0 scoring, sampled logprobs, aborts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.llm import LLM, Completion, GenerationError
from engine.outputs import ErrorCode, RequestOutput
from engine.protocol import EngineLimits, InvalidParamError, PromptTooLongError
from engine.worker.loader import load_model
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from tests.support.faults import FaultyRunner
from tests.support.models import tiny_config


def make(runner: ModelRunner, num_kv_blocks: int | None = None, **sched: object) -> LLMEngine:
    sc = SchedulerConfig(block_size=runner.block_size, **sched)  # type: ignore[arg-type]
    cfg = EngineConfig(model=None, dtype="float32", device="cpu", enforce_eager=True, num_kv_blocks=num_kv_blocks,
                       scheduler=sc)
    engine = LLMEngine(cfg, runner=runner)
    engine.load()
    return engine


def drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    return outs


def hf_prompt_logprobs(folder: Path, ids: list[int]) -> torch.Tensor:
    model = load_model(str(folder), device="cpu", dtype="float32").model
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]  # [len - 1]


def test_prompt_logprobs_survive_chunking_and_preemption(llama_runner: ModelRunner,
                                                         tiny_llama: Path) -> None:
    prompt = [(7 * i) % 300 + 3 for i in range(40)]
    scoring = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=2)
    filler = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    # 8-token chunks, and a pool too small for all three: the scorer gets preempted.
    engine = make(llama_runner, num_kv_blocks=22, max_num_batched_tokens=8)
    engine.add_request("f1", [5] * 20, filler)
    engine.add_request("f2", [6] * 20, filler)
    engine.add_request("score", prompt, scoring)
    outs = drain(engine)
    assert engine.stats().num_preemptions > 0
    final = outs["score"][-1]
    assert final.finish_reason == "length" and final.num_output_tokens == 0
    got = [o for o in outs["score"] if o.prompt_logprobs is not None]
    assert len(got) == 1
    plp = got[0].prompt_logprobs
    assert plp is not None and plp[0] is None and len(plp) == len(prompt)
    want = hf_prompt_logprobs(tiny_llama, prompt)
    ours = torch.tensor([lp.chosen.logprob for lp in plp[1:]])  # type: ignore[union-attr]
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    assert all(lp.chosen.token_id == t for lp, t in zip(plp[1:], prompt[1:]))  # type: ignore[union-attr]
    assert all(len(lp.top) == 2 for lp in plp[1:])  # type: ignore[union-attr]


def test_stop_string_ends_request_and_is_excluded(llama_runner: ModelRunner) -> None:
    engine = make(llama_runner)
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("free", [10, 11, 12], free)
    text = "".join(o.new_text for o in drain(engine)["free"])
    assert len(text) > 6
    stop = text[3:6]
    engine.add_request("stopped", [10, 11, 12],
                       SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                      stop=(stop,)))
    outs = drain(engine)["stopped"]
    assert "".join(o.new_text for o in outs) == text[:text.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def test_stop_token_id_reported_and_not_in_text(llama_runner: ModelRunner) -> None:
    engine = make(llama_runner)
    engine.add_request("a", [10, 11, 12], SamplingParams(temperature=0.0, max_tokens=12,
                                                         ignore_eos=True))
    ids = [t for o in drain(engine)["a"] for t in o.new_token_ids]
    stop_id = ids[4]
    engine.add_request("b", [10, 11, 12], SamplingParams(temperature=0.0, max_tokens=12,
                                                         ignore_eos=True,
                                                         stop_token_ids=(stop_id,)))
    outs = drain(engine)["b"]
    got = [t for o in outs for t in o.new_token_ids]
    cut = ids.index(stop_id)
    assert got == ids[:cut + 1]  # the stop token is generated (and counted) ...
    text = "".join(o.new_text for o in outs)
    assert text == engine.tokenizer.decode(ids[:cut])  # ... but not part of the text
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop_id


def test_sampled_logprobs_one_per_token(llama_runner: ModelRunner) -> None:
    engine = make(llama_runner)
    engine.add_request("lp", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=6,
                                                       ignore_eos=True, logprobs=3))
    outs = drain(engine)["lp"]
    lps = [lp for o in outs for lp in (o.logprobs or ())]
    ids = [t for o in outs for t in o.new_token_ids]
    assert [lp.chosen.token_id for lp in lps] == ids
    assert all(lp.rank == 1 and len(lp.top) == 3 and lp.top[0].token_id == lp.chosen.token_id
               for lp in lps)  # greedy: the chosen token is the best one


def test_abort_waiting_and_running(llama_runner: ModelRunner) -> None:
    engine = make(llama_runner, max_num_seqs=1)
    p = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("run", [3, 4], p)
    engine.add_request("wait", [3, 4], p)
    engine.step()
    engine.step()
    for rid in ("wait", "run"):
        final = engine.abort_request(rid)
        assert final is not None and final.finish_reason == "abort"
    assert engine.abort_request("run") is None  # unknown by now: nothing to send twice
    assert not engine.has_unfinished()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_stop_string_waits_for_min_tokens(llama_runner: ModelRunner) -> None:
    engine = make(llama_runner)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("free", [10, 11, 12], free)
    outs = drain(engine)["free"]
    text = "".join(o.new_text for o in outs)
    first_piece = engine.tokenizer.decode([outs[0].new_token_ids[0]])
    assert first_piece and first_piece in text
    engine.add_request("min", [10, 11, 12], SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, min_tokens=12, stop=(first_piece,)))
    outs = drain(engine)["min"]
    assert sum(len(o.new_token_ids) for o in outs) == 12  # the early match did not stop it
    assert outs[-1].finish_reason == "length"


def test_stop_string_completed_by_the_last_allowed_token_wins_over_length(
        llama_runner: ModelRunner) -> None:
    # The stop string is the whole 6-token answer: it completes in the step that also
    # reaches max_tokens. The scheduler relabels that finish: "stop", not "length".
    engine = make(llama_runner)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("free", [10, 11, 12], params)
    text = "".join(o.new_text for o in drain(engine)["free"])
    assert text
    engine.add_request("both", [10, 11, 12], dataclasses.replace(params, stop=(text,)))
    outs = drain(engine)["both"]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == text
    assert "".join(o.new_text for o in outs) == "" and outs[-1].num_output_tokens == 6


# ------------------------------------------------------------------------- failed steps


def test_failed_step_ends_its_requests_and_the_others_go_on(llama_runner: ModelRunner) -> None:
    runner = FaultyRunner(llama_runner)
    engine = make(runner, max_num_seqs=2)  # type: ignore[arg-type]
    p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for rid in ("a", "b", "queued"):
        engine.add_request(rid, [3, 4, 5], p)
    engine.step()  # a and b run; queued waits (max_num_seqs=2)
    runner.fail = 2
    outs = engine.step()  # raises inside: must not raise out of step()
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    for o in outs:
        assert o.finished and o.error_code == ErrorCode.STEP_FAILED
        assert o.error == "engine step failed: injected fault in step 2"
    assert engine.consecutive_failures == 1 and sorted(engine.requests) == ["queued"]
    assert engine.step()[0].error_code == ErrorCode.STEP_FAILED  # queued's first step fails
    assert engine.consecutive_failures == 2
    engine.add_request("later", [3, 4, 5], p)
    later = drain(engine)["later"]  # drain: every block is free again
    assert later[-1].finish_reason == "length" and later[-1].error is None
    assert engine.consecutive_failures == 0  # a successful step resets it
    engine.scheduler.check_invariants()


def test_failure_after_some_requests_ended_keeps_their_final_delta(
        llama_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    # Building b's delta raises after a's final delta was built: a keeps its answer ("length"),
    # b ends with STEP_FAILED, and nothing is left behind.
    engine = make(llama_runner)
    engine.add_request("a", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=1))
    engine.add_request("b", [6, 7, 8], SamplingParams(temperature=0.0, max_tokens=5))
    make_output = engine._make_output

    def failing(seq: Any, result: Any) -> RequestOutput | None:
        if seq.seq_id == "b":
            raise RuntimeError("detokenizer broke")
        return make_output(seq, result)

    monkeypatch.setattr(engine, "_make_output", failing)
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finish_reason == "length" and outs["a"].error is None
    assert outs["b"].error_code == ErrorCode.STEP_FAILED and "detokenizer broke" in (
        outs["b"].error or "")
    assert not engine.has_unfinished()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# ------------------------------------------------------------------------------- limits


def test_limits_are_resolved_once_from_config_model_and_pool(llama_runner: ModelRunner) -> None:
    # llama_runner: a 256-token model limit, 128 blocks of 4 tokens.
    engine = make(llama_runner, max_model_len=200)
    assert engine.limits == EngineLimits(
        max_model_len=200, num_kv_blocks=128, block_size=4, vocab_size=llama_runner.vocab_size,
        eos_token_ids=frozenset(llama_runner.eos_token_ids),
        max_prompt_bytes=2 * engine.tokenizer.max_token_bytes() * 200)
    assert make(llama_runner, max_model_len=4096).limits.max_model_len == 256  # the model's
    small = make(llama_runner, num_kv_blocks=10)  # the pool holds 40 tokens
    assert (small.limits.max_model_len, small.limits.num_kv_blocks) == (40, 10)
    assert small.scheduler.limits is small.limits
    with pytest.raises(PromptTooLongError, match="max_model_len is 40"):
        small.add_request("long", [3] * 40, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"prompt token id \d+ is out of range"):
        small.add_request("bad", [small.limits.vocab_size], SamplingParams(max_tokens=1))


def test_offline_completion_keeps_the_error_of_a_failed_step(llama_runner: ModelRunner) -> None:
    # LLM.generate no longer sees an exception from step(): the failure is per prompt.
    engine = make(FaultyRunner(llama_runner, fail=1))  # type: ignore[arg-type]
    engine.add_request("x", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=3))
    done = Completion("x")
    for out in engine.step():
        done.add(out)
    assert done.finish_reason == "abort" and done.error is not None
    assert done.error.startswith("engine step failed: injected fault")


def test_priority_is_refused_unless_the_priority_policy_is_on(llama_runner: ModelRunner) -> None:
    """Issue 38: under fcfs a priority was accepted and ignored; vLLM refuses it (400)."""
    params = SamplingParams(max_tokens=1)
    fcfs = make(llama_runner)
    fcfs.add_request("zero", [5, 6], params, priority=0)  # the default asks for nothing
    with pytest.raises(InvalidParamError, match="--scheduling-policy priority") as e:
        fcfs.add_request("three", [5, 6], params, priority=3)
    assert e.value.param == "priority" and "three" not in fcfs.requests
    make(llama_runner, policy="priority").add_request("three", [5, 6], params, priority=3)


def test_offline_generate_raises_when_the_engine_fails_a_prompt(
        llama_runner: ModelRunner, tiny_llama: Path) -> None:
    """issue 33: a failed step made LLM.generate return an empty completion, as if the model
    had said nothing. As vLLM's LLM, it raises; every prompt's result rides on the error."""
    llm = LLM(tiny_config(tiny_llama))
    llm.engine = make(FaultyRunner(llama_runner, fail=1))  # type: ignore[arg-type]
    with pytest.raises(GenerationError, match="of 2 prompt.s. failed: engine step failed") as e:
        llm.generate([[3, 4, 5], [6, 7]], SamplingParams(temperature=0.0, max_tokens=3),
                     use_tqdm=False)
    assert [c.error is not None for c in e.value.completions].count(True) >= 1
    llm.engine = make(llama_runner)
    [ok] = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=3),
                        use_tqdm=False)
    assert len(ok.token_ids) == 3 and ok.error is None
