"""The scheduler's plain data types: SamplingParams, SchedulerConfig, Sequence, SchedulerOutput."""

from __future__ import annotations

import math

import pytest

from scheduler import SamplingParams, SchedulerConfig, SchedulerOutput, Sequence, SequenceStatus


@pytest.mark.parametrize("field, value", [
    ("max_tokens", -1), ("temperature", -0.1), ("temperature", math.nan), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("min_p", 1.1), ("min_tokens", -1), ("min_tokens", 17),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("logit_bias", {5: 101.0}), ("logit_bias", {-1: 1.0}), ("stop_token_ids", (-1,)),
    ("stop", ("",)), ("logprobs", 21), ("prompt_logprobs", -1),
])
def test_sampling_params_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_sampling_params_defaults_and_flags() -> None:
    p = SamplingParams()
    assert p.max_tokens == 16 and not p.greedy and not p.needs_penalties
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(repetition_penalty=1.2).needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(logprobs=20, prompt_logprobs=0, logit_bias={3: -100.0}).logprobs == 20


@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"block_size": 0}, "block_size"),
    ({"policy": "lifo"}, "policy"),
    ({"decode_step_prefill_tokens": -1}, "decode_step_prefill_tokens"),
    ({"decode_step_prefill_tokens_per_seq": -1}, "decode_step_prefill_tokens_per_seq"),
    ({"target_itl_ms": -1.0}, "target_itl_ms"), ({"target_itl_ms": float("nan")}, "target_itl_ms"),
    ({"prefill_stretch": 0.5}, "prefill_stretch"),
])
def test_scheduler_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_prefill_chunk_cap() -> None:
    assert SchedulerConfig(max_num_batched_tokens=64).prefill_chunk_cap == 64
    assert SchedulerConfig(max_num_batched_tokens=64,
                           long_prefill_token_threshold=16).prefill_chunk_cap == 16
    assert SchedulerConfig(max_num_batched_tokens=64,
                           long_prefill_token_threshold=100).prefill_chunk_cap == 64


def test_sequence_token_views() -> None:
    seq = Sequence("a", [1, 2, 3], SamplingParams(), arrival_time=5.0)
    seq.append_token(9)
    assert (seq.num_tokens, seq.num_output_tokens, seq.last_token_id) == (4, 1, 9)
    assert seq.prompt_token_ids == [1, 2, 3] and seq.output_token_ids == [9]
    assert seq.num_uncomputed_tokens == 4 and seq.arrival_time == 5.0
    assert "WAITING" in repr(seq) and not seq.is_finished
    with pytest.raises(ValueError, match="at least one token"):
        Sequence("b", [], SamplingParams())


def test_status_order_and_finish_reasons() -> None:
    assert [s.is_finished for s in SequenceStatus] == [False, False, True, True, True]
    assert [s.finish_reason for s in SequenceStatus] == [None, None, "stop", "length", "abort"]


def test_scheduler_output_samples_only_at_the_end() -> None:
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams())
    out = SchedulerOutput([seq], [3])
    assert not out.is_empty and out.total_num_scheduled_tokens == 3 and not out.samples(0)
    seq.num_computed_tokens = 3
    out = SchedulerOutput([seq], [2])
    assert out.samples(0)
