"""PenaltyState: penalties from counts kept step by step give the logits that penalties rebuilt
from whole histories give (build_penalties), through random histories, requests joining and
leaving, preemption, n > 1, ids past the LM head and a reused request id."""

from __future__ import annotations

import random

import torch

from engine.sample.penalty_state import PenaltyState
from engine.sample.sampler import apply_penalties
from engine.sample.sampling_batch import Penalties, SamplingBatchBuilder, build_penalties
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence, SequenceStatus

V = 500
CPU = torch.device("cpu")


def reference(seqs: list[Sequence], vocab: int = V) -> Penalties:
    """Penalties rebuilt from each sequence's whole history."""
    p = [s.params for s in seqs]
    return build_penalties(list(range(len(seqs))), [s.prompt_token_ids for s in seqs],
                           [s.output_token_ids for s in seqs],
                           [x.repetition_penalty for x in p], [x.presence_penalty for x in p],
                           [x.frequency_penalty for x in p], CPU, vocab)


def penalised(rng: random.Random) -> SamplingParams:
    return SamplingParams(repetition_penalty=rng.choice([0.7, 1.0, 1.3]),
                          presence_penalty=rng.choice([-1.0, 0.0, 0.5]),
                          frequency_penalty=rng.choice([0.25, 1.5]), temperature=0.0)


def new_seq(rng: random.Random, name: str, vocab: int = V) -> Sequence:
    # narrow id range: prompt and output share tokens, outputs repeat
    prompt = [rng.randrange(vocab // 4) for _ in range(rng.randint(1, 40))]
    return Sequence(name, prompt, penalised(rng))


def same_logits(batch_pen: Penalties | None, seqs: list[Sequence], seed: int) -> bool:
    assert batch_pen is not None
    logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, ::7] = -logits[:, ::7].abs()  # negative logits too (repetition multiplies them)
    ours = apply_penalties(logits.clone(), batch_pen)
    return torch.equal(ours, apply_penalties(logits.clone(), reference(seqs)))


def test_counts_kept_step_by_step_match_rebuilt_ones_through_batch_changes() -> None:
    """Random steps: requests join, decode (some steps sitting out, as after a preemption),
    finish; each step the builder's penalties must give the reference logits."""
    rng = random.Random(0)
    builder = SamplingBatchBuilder(V, seed=0)
    live: list[Sequence] = []
    for step in range(120):
        if len(live) < 12 and rng.random() < 0.4:
            live.append(new_seq(rng, f"r{step}"))
        for seq in list(live):
            if rng.random() < 0.05:  # leaves: its slot is freed at the next step
                seq.status = SequenceStatus.FINISHED_STOPPED
                live.remove(seq)
        batch = [s for s in live if rng.random() < 0.8]  # the rest sit this step out
        if not batch:
            continue
        built = builder.build(batch, CPU)
        assert built.penalties is not None and built.penalties.rows.tolist() == list(
            range(len(batch)))
        assert same_logits(built.penalties, batch, step), step
        for seq in batch:  # the step's tokens: often repeats of what the request has seen
            seq.append_token(rng.choice(seq.token_ids) if rng.random() < 0.6
                             else rng.randrange(V))
    assert builder._penalty_state.num_held <= 12 + 1


def test_preempted_request_keeps_its_counts_and_n_choices_count_apart() -> None:
    """A preempted sequence keeps its tokens and recomputes: the counts carry on. Two choices
    of one prompt (n = 2) have separate counts."""
    rng = random.Random(1)
    params = penalised(rng)
    a, b = Sequence("req-0", [1, 2, 3, 2], params), Sequence("req-1", [1, 2, 3, 2], params)
    builder = SamplingBatchBuilder(V, seed=0)
    for step, t in enumerate([2, 9, 9, 4]):
        built = builder.build([a, b], CPU)
        assert same_logits(built.penalties, [a, b], step)
        a.append_token(t)
        b.append_token(t + 1)
    a.status, a.num_computed_tokens = SequenceStatus.WAITING, 0  # preempted: recompute
    for step in range(3):  # b runs alone meanwhile
        assert same_logits(builder.build([b], CPU).penalties, [b], 10 + step)
        b.append_token(9)
    a.status = SequenceStatus.RUNNING
    assert same_logits(builder.build([b, a], CPU).penalties, [b, a], 20)


def test_finished_requests_free_their_slots_for_new_ones() -> None:
    rng = random.Random(2)
    state = PenaltyState(V)
    first = [new_seq(rng, f"a{i}") for i in range(4)]
    state.table(first, CPU)
    assert state.num_held == 4
    for seq in first[:3]:
        seq.status = SequenceStatus.FINISHED_ABORTED
    later = [new_seq(rng, f"b{i}") for i in range(3)]
    _, table = state.table([first[3], *later], CPU)
    assert state.num_held == 4 and table is not None
    assert state._ids is not None and state._ids.shape[0] == 8  # no new rows: slots reused
    ref = reference([first[3], *later]).tokens
    assert torch.equal(table.token_ids, ref.token_ids)
    assert torch.equal(table.output_counts, ref.output_counts)


def test_a_new_sequence_under_a_known_id_is_rebuilt() -> None:
    """A request id reused by a new Sequence (or a history that shrank) starts over."""
    rng = random.Random(3)
    state, builder = PenaltyState(V), SamplingBatchBuilder(V, seed=0)
    old = new_seq(rng, "same")
    for t in (5, 5, 6):
        old.append_token(t)
    builder.build([old], CPU)
    fresh = Sequence("same", [7, 8], old.params)
    assert same_logits(builder.build([fresh], CPU).penalties, [fresh], 0)
    _, table = state.table([fresh], CPU)
    assert table is not None and sorted(table.token_ids[0].tolist()) == [7, 8]


def test_ids_past_the_head_are_skipped_and_rows_without_any_are_left_out() -> None:
    """An embedding larger than the LM head: prompt ids >= vocab are not penalised (HF skips
    them); a row with no id below vocab has nothing to penalise."""
    params = SamplingParams(repetition_penalty=2.0, temperature=0.0)
    some = Sequence("some", [V + 3, 4, V + 9], params)
    none = Sequence("none", [V + 1, V + 2], params)
    built = SamplingBatchBuilder(V, seed=0).build([none, some], CPU)
    assert built.penalties is not None and built.penalties.rows.tolist() == [1]
    assert built.penalties.tokens.token_ids.tolist() == [[4]]


def test_slots_grow_past_the_initial_width_and_rows() -> None:
    """Long histories (more distinct ids than the first width) and many requests."""
    rng = random.Random(4)
    vocab = 5000
    seqs = [Sequence(f"s{i}", [rng.randrange(vocab) for _ in range(1500)], penalised(rng))
            for i in range(20)]
    state = PenaltyState(vocab)
    for step in range(3):
        kept, table = state.table(seqs, CPU)
        assert kept == list(range(20)) and table is not None
        ref = reference(seqs, vocab).tokens
        assert torch.equal(table.token_ids, ref.token_ids), step
        assert torch.equal(table.output_counts, ref.output_counts), step
        for seq in seqs:
            seq.append_token(rng.randrange(vocab))


def test_a_drafting_rows_penalties_count_the_drafts_before_its_position() -> None:
    """Speculative decoding: a sequence with drafts d is in the batch once per position j it
    scores, and row j's penalties are those of its history followed by d[:j], whatever else
    is held (ids new to the slot, ids it holds, repeats, ids past the head), and the slot's
    own counts are left as they were."""
    rng = random.Random(3)
    builder = SamplingBatchBuilder(V, seed=0)
    seqs = [new_seq(rng, f"s{i}") for i in range(4)]
    for seq in seqs:
        for _ in range(rng.randint(0, 30)):
            seq.append_token(rng.randrange(V // 4))
    drafts = {"s0": [seqs[0].token_ids[0], V // 2, V // 2, V + 3],  # held, new twice, past head
              "s2": [rng.randrange(V) for _ in range(5)]}
    rows, offsets = [], []
    for seq in seqs:
        for j in range(1 + len(drafts.get(seq.seq_id, []))):
            rows.append(seq)
            offsets.append(j)
    for _ in range(2):  # the second time: nothing absorbed from the drafts
        batch = builder.build(rows, CPU, offsets=offsets, drafts=drafts)
        expected = []
        for seq, j in zip(rows, offsets, strict=True):
            twin = Sequence(seq.seq_id, seq.prompt_token_ids, seq.params)
            for t in seq.output_token_ids + drafts.get(seq.seq_id, [])[:j]:
                twin.append_token(t)
            expected.append(twin)
        assert same_logits(batch.penalties, expected, seed=7)
