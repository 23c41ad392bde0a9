"""The engine core's wire format (engine/core/messages.py): every payload the thread path
passes as an object survives msgspec's MessagePack unchanged, and every refusal comes back as
the exception type submit() raises on the thread path."""

from __future__ import annotations

import pytest

from engine.core.messages import (
    AddRequest,
    Admitted,
    Ready,
    StepDone,
    decode_to_client,
    decode_to_core,
    encode,
    refusal_error,
    refusal_info,
)
from engine.outputs import ErrorCode, Logprob, RequestOutput, RequestTimings, TokenLogprobs
from engine.protocol import EngineLimits, EngineStats
from scheduler.errors import InvalidParamError, PromptTooLongError, QueueFullError
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams


def test_requests_and_step_outputs_round_trip() -> None:
    params = SamplingParams(temperature=0.5, seed=3, stop=("x",), logit_bias={7: -1.5},
                            logprobs=2, structured_outputs=StructuredOutputsParams(
                                "json", '{"type": "object"}', "response_format"))
    add = AddRequest("r", [1, 2, 3], params, 2, 12.5, None)
    assert decode_to_core(encode(add)) == add
    lp = TokenLogprobs(Logprob(4, "a", -0.25), 1, (Logprob(4, "a", -0.25), Logprob(9, "é", -2.0)))
    out = RequestOutput("r", (4,), "a", finish_reason="length", stop_reason="x", logprobs=(lp,),
                        prompt_logprobs=(None, lp), prompt_token_ids=(1, 2, 3),
                        num_prompt_tokens=3, num_output_tokens=1, queue_time=0.5,
                        timings=RequestTimings(0.5, 0.1, None, 0.1), error="boom",
                        error_code=ErrorCode.STEP_FAILED)
    stats = EngineStats(num_running=1, num_kv_blocks=8, num_free_kv_blocks=6, finish_rate=2.5,
                        iteration_tokens=(1, 2), iteration_tokens_sum=9, cache_dtype="bfloat16")
    step = StepDone([out], stats, busy=True, dead=None)
    got = decode_to_client(encode(step))
    assert got == step and isinstance(got, StepDone)
    assert got.outputs[0].error_code is ErrorCode.STEP_FAILED
    limits = EngineLimits(64, 16, 4, 320, frozenset({1, 2}), max_prompt_bytes=999)
    ready = Ready(limits, stats, b"\x00pickled", [1, 2])
    assert decode_to_client(encode(ready)) == ready


@pytest.mark.parametrize("error", [
    PromptTooLongError("too long"), QueueFullError("full", "max_num_queued_tokens"),
    InvalidParamError("logit_bias", "logit_bias token id 999 is out of range"),
    ValueError("request id 'a' is already in use")])
def test_refusals_come_back_as_the_same_exception(error: Exception) -> None:
    msg = decode_to_client(encode(Admitted("r", refusal_info(error))))
    assert isinstance(msg, Admitted) and msg.refusal is not None
    back = refusal_error(msg.refusal)
    assert type(back) is type(error) and str(back) == str(error)
    assert getattr(back, "param", None) == getattr(error, "param", None)
    assert getattr(back, "limit", None) == getattr(error, "limit", None)


def test_an_unexpected_error_is_not_a_client_error() -> None:
    back = refusal_error(refusal_info(KeyError("bug")))
    assert type(back) is RuntimeError and "KeyError" in str(back)
