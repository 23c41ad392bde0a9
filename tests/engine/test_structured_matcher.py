"""The matcher and its bitmask agree: on random token streams drawn among the allowed tokens,
the matcher never leaves its grammar, and the tokens it rejects are exactly the masked ones.
Also: the sampler's bitmask unpacking, and rollback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine.sample.sampler import unpack_bitmask
from engine.structured_output.grammar import GrammarBackend, Matcher
from engine.structured_output.manager import StructuredOutputs
from scheduler.sampling_params import StructuredOutputsParams
from tests.support.structured import SCHEMAS

EOS = 1
SPECS = [StructuredOutputsParams("json", json.dumps(SCHEMAS[i])) for i in (1, 6, 9, 17, 21)] + [
    StructuredOutputsParams("json_object", ""),
    StructuredOutputsParams("regex", r"(ab|cd)+[0-9]{2}"),
    StructuredOutputsParams("choice", json.dumps(["alpha", "beta", "alphabet"])),
    StructuredOutputsParams("grammar", 'root ::= "(" [a-z]+ ("," [a-z]+)* ")"'),
]


@pytest.fixture(scope="module")
def hf_tok(tiny_llama: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def structured(hf_tok: Any) -> StructuredOutputs:
    return StructuredOutputs(hf_tok, len(hf_tok), [EOS])


def allowed(structured: StructuredOutputs, m: Matcher) -> list[int]:
    masks = structured.fill([("x", m, [])])
    return unpack_bitmask(masks.bitmask, structured.backend.vocab_size)[0].nonzero()[:, 0].tolist()


def raw_allowed(backend: GrammarBackend, m: Matcher) -> torch.Tensor:
    bitmask = torch.zeros(1, backend.words, dtype=torch.int32)
    m.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, backend.vocab_size)[0]


@settings(max_examples=40, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(spec=st.sampled_from(SPECS), picks=st.lists(st.integers(0, 10**6), min_size=1,
                                                   max_size=40),
       probes=st.lists(st.integers(0, 10**6), min_size=4, max_size=4))
def test_random_allowed_streams_never_leave_the_grammar(
        structured: StructuredOutputs, spec: StructuredOutputsParams, picks: list[int],
        probes: list[int]) -> None:
    backend = structured.backend
    m = backend.matcher(structured.compile(spec).result(timeout=60))
    for pick in picks:
        if m.is_terminated():
            break
        ok = allowed(structured, m)
        assert ok, "a live grammar must allow some token"
        raw = raw_allowed(backend, m)
        assert all(raw[t] for t in ok)  # our extra masking only ever removes tokens
        for probe in probes:  # rejected tokens are exactly the masked ones
            t = probe % backend.vocab_size
            accepted = m.accept_token(t)
            assert accepted == bool(raw[t]), (t, accepted)
            if accepted:
                m.rollback(1)
        token = ok[pick % len(ok)]
        assert m.accept_token(token), token
    if m.is_terminated():
        assert not any(m.accept_token(t) for t in range(backend.vocab_size))


def test_unpack_bitmask_matches_bit_positions() -> None:
    words = torch.tensor([[1 - (1 << 31), 0, 1 << 5]], dtype=torch.int32)  # tokens 0, 31, 69
    bits = unpack_bitmask(words, 70)
    assert bits.shape == (1, 70) and bits[0].nonzero()[:, 0].tolist() == [0, 31, 69]


def test_rollback_restores_the_state(structured: StructuredOutputs) -> None:
    m = structured.backend.matcher(
        structured.compile(StructuredOutputsParams("choice", '["ab", "cd"]')).result(60))
    before = allowed(structured, m)
    token = before[0]
    assert m.accept_token(token)
    assert allowed(structured, m) != before
    m.rollback(1)
    assert allowed(structured, m) == before


def test_special_and_control_tokens_are_never_allowed_in_json(
        structured: StructuredOutputs, hf_tok: Any) -> None:
    tok = structured.backend
    m = tok.matcher(structured.compile(StructuredOutputsParams(
        "json", json.dumps({"type": "string", "maxLength": 50}))).result(60))
    assert m.accept_token(hf_tok.encode('"', add_special_tokens=False)[0])
    ok = set(allowed(structured, m))
    assert not ok & set(tok.forbidden_in_json) and tok.forbidden_in_json
    assert set(raw_allowed(tok, m).nonzero()[:, 0].tolist()) & set(tok.forbidden_in_json)



# -- drafts (speculative decoding with a grammar) ---------------------------------------------


def _regex_matcher(structured: StructuredOutputs, pattern: str) -> Matcher:
    return structured.backend.matcher(
        structured.compile(StructuredOutputsParams("regex", pattern)).result(60))


def test_a_drafting_rows_masks_are_the_grammars_after_each_draft(
        structured: StructuredOutputs, hf_tok: Any) -> None:
    """Row j of a drafting sequence is the mask after its first j drafts; after a refused
    draft the rows repeat the last valid one (nothing there can be kept); the matcher ends
    where it began."""
    m = _regex_matcher(structured, r"(ab|cd)+[0-9]{2}")
    drafts = hf_tok.encode("abcdab", add_special_tokens=False)
    refused = hf_tok.encode("x", add_special_tokens=False)
    before = allowed(structured, m)
    masks = structured.fill([("s", m, [*drafts, *refused, drafts[0]]), ("t", m, [])])
    n = len(drafts)
    assert masks.seq_ids == ("s",) * (n + 3) + ("t",)
    assert masks.offsets == (*range(n + 3), 0)
    rows = unpack_bitmask(masks.bitmask, structured.backend.vocab_size)
    expected = []
    for j in range(n + 1):
        expected.append(allowed(structured, m))
        if j < n:
            assert m.accept_token(drafts[j])
    m.rollback(n)
    for j in range(n + 1):
        assert rows[j].nonzero()[:, 0].tolist() == expected[j], j
    assert torch.equal(rows[n + 1], rows[n]) and torch.equal(rows[n + 2], rows[n])
    assert rows[n + 3].nonzero()[:, 0].tolist() == before  # "t": the state it was left in
    assert allowed(structured, m) == before


def test_drafts_are_cut_at_the_first_the_grammar_refuses(structured: StructuredOutputs,
                                                         hf_tok: Any) -> None:
    """GrammarTracker.valid_drafts, the scheduler's draft filter: the drafts before the first
    refused one, the matcher left where it was (asked twice, the same answer)."""
    from engine.core.grammar_tracker import GrammarTracker
    from scheduler.sampling_params import SamplingParams
    from scheduler.sequence import Sequence

    def ids(text: str) -> list[int]:
        return list(hf_tok.encode(text, add_special_tokens=False))

    tracker = GrammarTracker(lambda: structured)
    free = Sequence("free", [1, 2], SamplingParams())
    assert tracker.valid_drafts(free, ids("x12")) == ids("x12")  # no grammar: as proposed
    so = StructuredOutputsParams("regex", r"ab[0-9]{2}")
    seq = Sequence("seq", [1, 2], SamplingParams(structured_outputs=so))
    tracker.track(seq, structured.compile(so))
    structured.compile(so).result(60)
    assert tracker.poll().ready == ["seq"]
    for _ in range(2):
        assert tracker.valid_drafts(seq, ids("ab") + ids("x") + ids("12")) == ids("ab")
        assert tracker.valid_drafts(seq, ids("x") + ids("ab")) == []
        assert tracker.valid_drafts(seq, ids("ab") + ids("1")) == ids("ab") + ids("1")
