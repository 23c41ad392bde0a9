"""When a sequence stops, in one place (vLLM's rules): EOS and stop token ids, the min_tokens
gate that holds them and stop strings back, max_tokens, max_model_len, and the grammar's end.

Who applies what: the scheduler finishes a sequence after each sampled token
(`after_token`); the sampler bans the stop tokens while the gate is closed (`stop_tokens`,
`may_stop`); the detokenizer looks for stop strings only once it is open (`may_stop`); the
engine finishes a sequence whose grammar has ended (`GRAMMAR_END`). Pure Python.
"""

from __future__ import annotations

from collections.abc import Collection

from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence, SequenceStatus

# A grammar that has ended finishes its sequence ("stop"), whatever min_tokens or ignore_eos
# say: nothing more may follow.
GRAMMAR_END = SequenceStatus.FINISHED_STOPPED


def may_stop(seq: Sequence) -> bool:
    """EOS, stop token ids and stop strings count only from min_tokens output tokens on."""
    return seq.num_output_tokens >= seq.params.min_tokens


def is_stop_token(params: SamplingParams, token_id: int,
                  eos_token_ids: Collection[int]) -> bool:
    """Whether `token_id` ends a sequence (once it may stop): one of its stop_token_ids, or
    EOS unless EOS is ignored. Membership tests only: this runs for every sampled token."""
    return token_id in params.stop_token_ids or (
        not params.ignore_eos and token_id in eos_token_ids)


def stop_tokens(params: SamplingParams, eos_token_ids: Collection[int]) -> set[int]:
    """The tokens is_stop_token accepts, which the sampler bans before min_tokens."""
    ids = set(params.stop_token_ids)
    return ids if params.ignore_eos else ids.union(eos_token_ids)


def after_token(seq: Sequence, token_id: int, eos_token_ids: Collection[int],
                max_model_len: int) -> tuple[SequenceStatus, int | None] | None:
    """How `seq` finishes now that `token_id` is its last token (status, stop reason), or
    None while it goes on."""
    if may_stop(seq) and is_stop_token(seq.params, token_id, eos_token_ids):
        return SequenceStatus.FINISHED_STOPPED, token_id
    if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH, None
    return None
