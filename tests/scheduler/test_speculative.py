"""Speculative decoding's scheduler side: the --speculative-config JSON, the n-gram proposer,
its switch-off, and the scheduler's drafts: bounded, never preempting, rolled back exactly
(FakeRunner checks every K/V read against the tokens it was computed from)."""

from __future__ import annotations

import json
import re

import pytest

from scheduler import SchedulerConfig, SequenceStatus
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from scheduler.speculative import (
    MAX_PAUSE_STEPS,
    PAUSE_STEPS,
    NgramIndex,
    NgramProposer,
    SpecDecodeStats,
    SpeculativeConfig,
    break_even,
    draft_room,
    parse_speculative_config,
)
from scheduler.suffix_decoding import SuffixIndex, SuffixProposer
from tests.support.schedsim import FakeRunner, assert_all_free, make_scheduler, make_seq, step

PERIOD = 5


def periodic(tokens: list[int]) -> int:
    """A "model" that repeats its last PERIOD tokens, but for a twist every 11th token: the
    n-gram drafts are mostly right and sometimes wrong."""
    t = tokens[-PERIOD]
    return t + 1 if len(tokens) % 11 == 0 else t


def generate_alone(prompt: list[int], max_tokens: int, stop: int | None = None) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(periodic(ids))
        ids.append(out[-1])
        if out[-1] == stop:
            break
    return out


def spec(**fields: object) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": 4, **fields})


def make_sched(num_blocks: int = 64, eos: tuple[int, ...] = (), **cfg: object) -> Scheduler:
    defaults: dict[str, object] = {"block_size": 4, "max_num_batched_tokens": 64,
                                   "max_num_seqs": 8, "max_model_len": 256,
                                   "speculative_config": spec(disable_by_batch_size=0)}
    defaults.update(cfg)
    return make_scheduler(SchedulerConfig(**defaults), num_blocks, eos)  # type: ignore[arg-type]


def drain(sched: Scheduler, runner: FakeRunner) -> None:
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        step(sched, runner)
    assert not sched.has_unfinished()
    assert_all_free(sched)


PROMPT = [7, 8, 9, 10, 11] * 3


# -- the config ------------------------------------------------------------------------------


def test_config_parses_vllms_json_with_our_defaults() -> None:
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg == SpeculativeConfig("ngram", 3, 2, 5, 8)
    cfg = parse_speculative_config(spec(prompt_lookup_max=3))
    assert cfg is not None and (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 3)
    cfg = parse_speculative_config(spec(prompt_lookup_min=7))
    assert cfg is not None and (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (7, 7)
    assert SchedulerConfig(speculative_config=spec()).speculative == SpeculativeConfig()


@pytest.mark.parametrize(("text", "says"), [
    ("{", "not JSON"), ("[1]", "JSON object"), ('{"method": "eagle"}', "not supported"),
    ('{"method": "draft_model"}', "not supported"), (spec(num_speculative_tokens=0), "[1, 32]"),
    (spec(num_speculative_tokens=33), "[1, 32]"), (spec(num_speculative_tokens="4"), "integer"),
    (spec(num_speculative_tokens=True), "integer"),
    (spec(prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min <="),
    (spec(prompt_lookup_min=0), "prompt_lookup_min <="), (spec(disable_by_batch_size=-1), ">= 0"),
    (spec(draft_model="x"), "unknown field(s) draft_model"),
])
def test_bad_configs_are_refused_naming_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="speculative_config") as e:
        SchedulerConfig(speculative_config=text)
    assert says in str(e.value)


# -- the proposer ----------------------------------------------------------------------------


def test_ngram_index_takes_the_longest_then_the_most_recent_match() -> None:
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert index.propose(tokens, 3) == [4, 5, 9]  # (1, 2, 3) matches at 0: longest
    tokens += [4, 7, 1, 2]  # (1, 2) ends at 2 and at 9, each a 2-token match: the newer wins
    assert index.propose(tokens, 3) == [3, 4, 7]
    assert index.propose(tokens, 1) == [3]


def test_ngram_index_never_matches_the_newest_ngram_with_itself() -> None:
    index = NgramIndex(2, 3)
    assert index.propose([1, 2], 4) == []
    assert index.propose([1, 2, 3], 4) == []  # (2, 3) occurs only at the end
    assert index.propose([1, 2, 3, 1, 2], 4) == [3, 1, 2]  # continuation runs up to the end


def test_ngram_index_is_incremental_and_equal_to_a_fresh_one() -> None:
    kept = NgramIndex(1, 3)
    tokens = [5, 6, 5, 7, 5, 6]
    for t in [5, 7, 6, 6, 5, 6, 5]:
        tokens.append(t)
        assert kept.propose(tokens, 3) == NgramIndex(1, 3).propose(tokens, 3)


def test_proposer_pauses_a_sequence_whose_drafts_do_not_pay() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4))
    seq = make_seq("a", PROMPT)
    assert proposer.propose(seq, 4) == [7, 8, 9, 10]
    proposer.observe("a", 4, 0)  # the EMA starts above break-even: one miss is not enough
    assert proposer.propose(seq, 4)
    proposer.observe("a", 4, 0)
    for _ in range(PAUSE_STEPS):  # now paused: PAUSE_STEPS steps without drafts
        assert proposer.propose(seq, 4) == []
    assert proposer.propose(seq, 4)  # then one probe, which decides
    proposer.observe("a", 4, 0)
    waits = 0
    while not proposer.propose(seq, 4):
        waits += 1
    assert waits == 2 * PAUSE_STEPS  # a second failure: the pause doubled
    proposer.observe("a", 4, 4)  # a draft that paid halves it again
    proposer.observe("a", 4, 0)
    proposer.observe("a", 4, 0)
    waits = 0
    while not proposer.propose(seq, 4):
        waits += 1
    assert PAUSE_STEPS <= waits < 4 * PAUSE_STEPS <= MAX_PAUSE_STEPS
    assert break_even(4) < 2 < break_even(16)


@pytest.mark.parametrize(("params", "outputs", "room"), [
    ({"temperature": 0.0, "max_tokens": 8}, 0, 7),
    ({"temperature": 0.7, "top_p": 0.9, "seed": 3, "max_tokens": 8}, 5, 2),
    ({"temperature": 0.0, "presence_penalty": 0.5, "max_tokens": 8}, 0, 7),
    ({"temperature": 1.0, "repetition_penalty": 1.1, "logprobs": 0, "max_tokens": 8}, 0, 7),
    ({"temperature": 0.0, "structured_outputs": StructuredOutputsParams("regex", "a+"),
      "max_tokens": 8}, 0, 7),
    # before min_tokens: a run ends a token short of the gate, which is decoded alone
    ({"temperature": 0.0, "min_tokens": 6, "max_tokens": 20}, 0, 4),
    ({"temperature": 0.0, "min_tokens": 6, "max_tokens": 20}, 4, 0),
    ({"temperature": 0.0, "min_tokens": 6, "max_tokens": 20}, 5, -1),
    ({"temperature": 0.0, "min_tokens": 6, "max_tokens": 20}, 6, 13),
])
def test_draft_room_follows_max_tokens_and_the_min_tokens_gate(params: dict[str, object],
                                                               outputs: int, room: int) -> None:
    seq = Sequence("a", [1, 2, 3], SamplingParams(**params))  # type: ignore[arg-type]
    for t in range(outputs):
        seq.append_token(10 + t)
    assert draft_room(seq) == room


def test_stats_count_as_vllms_counters() -> None:
    stats = SpecDecodeStats(3)
    assert stats.mean_acceptance_length == 0.0
    stats.observe(3, 2)
    stats.observe(2, 0)
    stats.observe(3, 3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 5)
    assert stats.accepted_per_pos == [2, 2, 1]
    assert stats.mean_acceptance_length == pytest.approx(1 + 5 / 3)


# -- the scheduler's drafts ------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_with_drafts_is_the_output_without(k: int) -> None:
    sched = make_sched(speculative_config=spec(num_speculative_tokens=k,
                                               disable_by_batch_size=0))
    seqs = [make_seq(f"s{i}", PROMPT[i:], max_tokens=40 + i, temperature=0.0)
            for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    drain(sched, FakeRunner(sched, periodic))
    for seq in seqs:
        assert seq.output_token_ids == generate_alone(seq.prompt_token_ids,
                                                      seq.params.max_tokens)
        assert seq.status == SequenceStatus.FINISHED_LENGTH
    stats = sched.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > stats.num_drafts * min(k, 2) / 2
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # ... and had drafts rejected


def test_drafts_stop_at_eos_max_tokens_and_max_model_len() -> None:
    sched = make_sched(eos=(12,), max_model_len=48)
    eos = make_seq("eos", PROMPT, max_tokens=60, temperature=0.0)  # twists 11 -> 12 (EOS)
    short = make_seq("short", PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
    long = make_seq("long", PROMPT, max_tokens=60, temperature=0.0, ignore_eos=True)
    for seq in (eos, short, long):
        sched.add(seq)
    runner = FakeRunner(sched, periodic)
    while sched.has_unfinished():
        before = {s.seq_id: (s.num_output_tokens, s.num_tokens) for s in sched.running}
        out, _ = step(sched, runner)
        for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
            drafts = out.draft_token_ids.get(seq.seq_id, [])
            if drafts:
                num_output, num_tokens = before[seq.seq_id]
                assert num_output + len(drafts) < seq.params.max_tokens
                assert num_tokens + len(drafts) < 48 and n == 1 + len(drafts)
    assert_all_free(sched)
    assert eos.output_token_ids == generate_alone(PROMPT, 60, stop=12)
    assert eos.status == SequenceStatus.FINISHED_STOPPED and eos.stop_reason == 12
    assert short.output_token_ids == generate_alone(PROMPT, 6)
    assert long.num_tokens == 48 and long.status == SequenceStatus.FINISHED_LENGTH
    assert long.output_token_ids == generate_alone(PROMPT, 48 - len(PROMPT))


def test_the_draft_filter_cuts_the_drafts_before_their_blocks_are_taken() -> None:
    """Scheduler.draft_filter (the engine's grammar check): the drafts carried are the cut
    ones, a sequence whose drafts are all cut decodes one token, and the output is decoding's."""
    sched = make_sched()
    calls: dict[str, int] = {"a": 0, "b": 0}

    def cut(seq: Sequence, drafts: list[int]) -> list[int]:
        calls[seq.seq_id] += 1
        return drafts[:2] if seq.seq_id == "a" else []

    sched.draft_filter = cut
    a = make_seq("a", PROMPT, max_tokens=30, temperature=0.0)
    b = make_seq("b", PROMPT[1:], max_tokens=30, temperature=0.0)
    sched.add(a)
    sched.add(b)
    runner = FakeRunner(sched, periodic)
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        assert "b" not in out.draft_token_ids
        assert len(out.draft_token_ids.get("a", [])) <= 2
    assert_all_free(sched)
    assert calls["a"] > 0 and calls["b"] > 0
    assert a.output_token_ids == generate_alone(PROMPT, 30)
    assert b.output_token_ids == generate_alone(PROMPT[1:], 30)
    assert sched.spec_stats.num_accepted_tokens > 0


def test_no_drafts_above_the_batch_size_limit_nor_before_min_tokens() -> None:
    sched = make_sched(speculative_config=spec(disable_by_batch_size=2))
    for i in range(3):
        sched.add(make_seq(f"g{i}", PROMPT, max_tokens=30, temperature=0.0))
    runner = FakeRunner(sched, periodic)
    for _ in range(5):
        out, _ = step(sched, runner)
        assert not out.draft_token_ids  # 3 running > 2
    sched.abort("g0")
    out, _ = step(sched, runner)
    assert set(out.draft_token_ids) == {"g1", "g2"}
    sched.abort("g1")
    t = make_seq("t", PROMPT, max_tokens=30, temperature=0.0, min_tokens=9)
    sched.add(t)
    runs = []
    while t.status != SequenceStatus.FINISHED_LENGTH:
        before = t.num_output_tokens
        out, _ = step(sched, runner)
        if "t" in out.draft_token_ids:
            runs.append((before, before + 1 + len(out.draft_token_ids["t"])))
    assert any(end <= 8 for _, end in runs) and any(start >= 9 for start, _ in runs)
    assert all(end <= 8 or start >= 9 for start, end in runs), runs  # none opens the gate


def test_drafts_never_cause_a_preemption() -> None:
    # 18 blocks of 4 hold both sequences whole (15 + 20 tokens: 9 blocks each), so decoding
    # alone never preempts; drafts must not either, though they take blocks early.
    sched = make_sched(num_blocks=18, max_model_len=40)
    a = make_seq("a", PROMPT, max_tokens=20, temperature=0.0)
    b = make_seq("b", PROMPT, max_tokens=20, temperature=0.0)
    sched.add(a)
    sched.add(b)
    drain(sched, FakeRunner(sched, periodic))
    assert sched.num_preemptions == 0 and sched.spec_stats.num_drafts > 0
    assert a.output_token_ids == generate_alone(PROMPT, 20)
    assert b.output_token_ids == generate_alone(PROMPT, 20)


def test_a_preempted_draft_is_dropped_and_its_sequence_recomputed() -> None:
    sched = make_sched(num_blocks=12, max_model_len=48)
    seqs = [make_seq(f"s{i}", PROMPT, max_tokens=30, temperature=0.0) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    drain(sched, FakeRunner(sched, periodic))
    assert sched.num_preemptions > 0
    for seq in seqs:
        assert seq.output_token_ids == generate_alone(PROMPT, 30)


def test_drafts_do_not_count_against_the_prompt_cap() -> None:
    sched = make_sched(decode_step_prefill_tokens=4)
    sched.add(make_seq("a", PROMPT, max_tokens=30, temperature=0.0))
    runner = FakeRunner(sched, periodic)
    step(sched, runner)  # its prompt, alone
    sched.add(make_seq("b", list(range(40, 60)), max_tokens=4, temperature=0.0))
    out, _ = step(sched, runner)
    assert out.draft_token_ids.get("a")
    assert dict(zip((s.seq_id for s in out.seqs), out.num_scheduled_tokens, strict=True))["b"] == 4


def test_drafts_under_a_sliding_window_read_only_held_blocks() -> None:
    """Every query of a drafting row sees its own window: FakeRunner checks each position a
    query may see is still held and holds the right tokens, as blocks fall out behind."""
    cfg = SchedulerConfig(block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
                          max_model_len=256, speculative_config=spec(disable_by_batch_size=0))
    sched = make_scheduler(cfg, 64, sliding_window=8)
    seqs = [make_seq(f"s{i}", PROMPT, max_tokens=60, temperature=0.0) for i in range(2)]
    for seq in seqs:
        sched.add(seq)
    runner = FakeRunner(sched, periodic)
    held = []
    while sched.has_unfinished():
        step(sched, runner)
        held += [sum(b >= 0 for b in s.block_table) for s in sched.running]
    assert_all_free(sched)
    assert max(held) <= 5 and sched.spec_stats.num_accepted_tokens > 0
    for seq in seqs:
        assert seq.output_token_ids == generate_alone(PROMPT, 60)


def test_a_stop_string_inside_a_verified_run_drops_the_tokens_after_it() -> None:
    sched = make_sched()
    seq = make_seq("a", PROMPT, max_tokens=30, temperature=0.0)
    sched.add(seq)
    runner = FakeRunner(sched, periodic)
    while not sched.spec_stats.num_accepted_tokens:
        step(sched, runner)
    n = seq.num_output_tokens
    sched.stop_on_string(seq, "stop", n - 2)  # the string ended two tokens before the run did
    assert seq.num_output_tokens == n - 2 and seq.stop_reason == "stop"
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.block_table == []
    assert_all_free(sched)


# -- suffix decoding -------------------------------------------------------------------------


def test_suffix_config_fields_take_vllms_names() -> None:
    cfg = parse_speculative_config(json.dumps({
        "method": "suffix", "num_speculative_tokens": 24, "suffix_decoding_max_tree_depth": 32,
        "suffix_decoding_max_cached_requests": 10, "suffix_decoding_max_spec_factor": 2,
        "suffix_decoding_min_token_prob": 0.25}))
    assert cfg is not None and cfg.method == "suffix" and cfg.num_speculative_tokens == 24
    assert (cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests,
            cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob) == (
        32, 10, 2, 0.25)
    for field, value, says in [("suffix_decoding_max_tree_depth", 1, ">= 2"),
                               ("suffix_decoding_max_cached_requests", -1, ">= 0"),
                               ("suffix_decoding_max_spec_factor", 0, "> 0"),
                               ("suffix_decoding_min_token_prob", 1.5, "[0, 1]"),
                               ("suffix_decoding_min_token_prob", "x", "a number"),
                               ("suffix_decoding_max_tree_depth", 2.5, "an integer")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_speculative_config(json.dumps({"method": "suffix", field: value}))


def test_suffix_index_votes_among_the_longest_matches() -> None:
    index = SuffixIndex()
    index.update(1, [9, 1, 2, 3, 4, 5])
    index.update(2, [8, 1, 2, 3, 4, 6])
    index.update(3, [7, 7, 2, 3, 4, 7])
    # (2, 3) occurs in all three; the longest suffix of the context, (1, 2, 3), in 1 and 2,
    # which agree on 4 and then split on 5 / 6 (probability 1/2)
    draft, score = index.continuation([0, 1, 2, 3], 24, 9.0, 0.1, 8)
    assert draft == [4, 5] and score == pytest.approx(1 + 0.5)
    assert index.continuation([0, 1, 2, 3], 24, 9.0, 0.6, 8)[0] == [4]  # 1/2 < 0.6: stop
    assert index.continuation([0, 1, 2, 3], 24, 9.0, 0.1, 1)[0] == [4]  # k
    assert index.continuation([0, 1, 2, 3], 24, 0.4, 0.1, 8)[0] == [4]  # 0.4 x 3 tokens
    assert index.continuation([5, 5], 24, 1.0, 0.1, 8) == ([], 0.0)  # no match
    assert index.continuation([3], 24, 1.0, 0.1, 8) == ([], 0.0)  # shorter than the anchor
    index.remove(1)
    assert index.continuation([0, 1, 2, 3], 24, 9.0, 0.1, 8)[0] == [4, 6]
    index.remove(2)
    index.remove(3)
    assert index.seqs == {} and index.continuation([2, 3], 24, 9.0, 0.0, 8) == ([], 0.0)


def test_suffix_index_of_a_growing_sequence_never_matches_its_newest_tokens() -> None:
    index = SuffixIndex()
    tokens = [1, 2, 3]
    index.update(0, tokens)
    assert index.continuation(tokens, 24, 9.0, 0.0, 4) == ([], 0.0)
    tokens += [1, 2]
    index.update(0, tokens)
    assert index.continuation(tokens, 24, 9.0, 0.0, 4)[0] == [3, 1, 2]  # up to the end only


def test_suffix_proposer_drafts_from_finished_requests_outputs() -> None:
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=8,
                            suffix_decoding_max_cached_requests=2)
    proposer = SuffixProposer(cfg)
    call = [40, 41, 42, 43, 44, 45, 46, 47]
    first = make_seq("first", [1, 2, 3, 30, 31])
    assert proposer.propose(first, 8) == []  # nothing seen yet
    first.token_ids += call  # its answer: a tool call
    proposer.finish(first)
    second = make_seq("second", [5, 6, 40, 41, 42])  # starts the same call
    assert proposer.propose(second, 8) == [43, 44, 45]  # 3 matched tokens, factor 1
    proposer.finish(second)  # nothing generated: not cached
    for i in range(2):  # two more outputs push the call out of a 2-request cache
        other = make_seq(f"o{i}", [1])
        other.token_ids += [60 + i, 61 + i, 62 + i]
        proposer.finish(other)
    assert proposer.propose(make_seq("third", [40, 41, 42]), 8) == []
    off = SuffixProposer(SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=0))
    off.finish(first)
    assert off.propose(make_seq("fourth", [40, 41, 42]), 8) == []


def test_suffix_proposer_prefers_the_requests_own_tokens_when_they_score_higher() -> None:
    proposer = SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=4))
    done = make_seq("done", [0])
    done.token_ids += [7, 8, 1]
    proposer.finish(done)  # the cache says 7, 8 -> 1, once
    seq = make_seq("a", [7, 8, 2, 7, 8, 2, 7, 8])  # its own tokens say 7, 8 -> 2, twice
    assert proposer.propose(seq, 4)[0] == 2


def test_suffix_decoding_keeps_decodings_tokens_and_learns_across_requests() -> None:
    """An agent loop: each request repeats the previous one's answer. The first request
    drafts from its own tokens only; later ones get the cached answers' continuations and
    keep more of their drafts. Every output equals decoding alone."""
    sched = make_sched(speculative_config=json.dumps({
        "method": "suffix", "num_speculative_tokens": 8, "disable_by_batch_size": 0}))
    runner = FakeRunner(sched, periodic)
    kept = []
    for i in range(3):
        seq = make_seq(f"r{i}", PROMPT, max_tokens=40, temperature=0.0)
        sched.add(seq)
        before = sched.spec_stats.num_accepted_tokens
        drain(sched, runner)
        assert seq.output_token_ids == generate_alone(PROMPT, 40)
        kept.append(sched.spec_stats.num_accepted_tokens - before)
    assert 0 < kept[0] < kept[1] <= kept[2], kept
