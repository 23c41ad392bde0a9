"""PenaltyState: each penalised request's token counts, kept across steps and updated with
each step's new tokens only (vLLM's persistent batch keeps them the same way).

Rebuilding the counts from the whole history every step cost 5-10 ms at 64 rows of 1.1k
tokens (a Python flatten of every prompt and output, then a sort of all of it). Here a request
owns a slot: row `slot` of `ids` [R, W] lists the distinct token ids it has seen (prompt and
output, in first-seen order) and the same row of `counts` [R, W] how often each occurs in its
output (0: in the prompt only). A step appends what is new since the request's last step.

What must stay true:
- counts are per request, from its own tokens: a Sequence only ever appends to token_ids, so
  what was absorbed stays valid across preemption (recompute keeps the tokens) and the steps a
  request sits out. A new Sequence under a known id (or one with fewer tokens than absorbed)
  is rebuilt from its history.
- a request that leaves frees its slot: entries hold their Sequence weakly and are dropped
  once it is finished or gone (checked at every step that has penalties: the runner has no
  "request ended" call, and needs none).
- ids past the LM head (an embedding larger than the head) are never stored, as HF skips them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from engine.worker.step_tensors import to_device
from scheduler.sequence import Sequence

_INITIAL_ROWS = 8
_INITIAL_WIDTH = 1024


@dataclass(frozen=True, slots=True, eq=False)
class TokenTable:
    """Rows' seen tokens, rectangular: row i lists its distinct token ids in token_ids[i] and
    their output counts in output_counts[i]; a row with fewer than L ids repeats its first
    (same id, same count: its penalised logit is written twice with the same value)."""

    token_ids: torch.Tensor  # [p, L] long
    output_counts: torch.Tensor  # [p, L] float32


@dataclass(slots=True)
class _Entry:
    """One request's slot and how much of its tokens the slot holds."""

    seq: weakref.ref[Sequence]
    slot: int
    absorbed: int = 0  # seq.token_ids[:absorbed] are counted
    column: dict[int, int] = field(default_factory=dict)  # token id -> its column in the slot


@dataclass(slots=True)
class _Writes:
    """One step's changes, gathered in Python, applied with one op each."""

    reset: list[int] = field(default_factory=list)  # slots whose counts start over
    new: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, column, token id)
    counted: list[tuple[int, int]] = field(default_factory=list)  # (slot, column): count += 1


class PenaltyState:
    """The slots of the requests that asked for penalties, on one device."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._entries: dict[str, _Entry] = {}
        self._free: list[int] = []
        self._num_slots = 0
        self._ids: torch.Tensor | None = None  # [R, W] long
        self._counts: torch.Tensor | None = None  # [R, W] float32

    @property
    def num_held(self) -> int:
        """Requests holding a slot."""
        return len(self._entries)

    def table(self, seqs: list[Sequence], device: torch.device,
              drafted: list[list[int]] | None = None) -> tuple[list[int], TokenTable | None]:
        """Absorb what each of seqs appended since its last step, then -> (the positions in
        seqs that hold a token id in the vocabulary, their table; None if none does).
        `drafted`: per position, tokens that count as output after the sequence's own (a
        speculating row's drafts before its position); they are not absorbed."""
        self._use(device)
        self._drop_finished()
        writes = _Writes()
        entries = [self._absorb(seq, writes) for seq in seqs]
        self._apply(writes, device)
        extras = [self._extra_columns(e, d)
                  for e, d in zip(entries, drafted or [[]] * len(entries), strict=True)]
        kept = [i for i, (e, x) in enumerate(zip(entries, extras, strict=True))
                if e.column or x.new]
        if not kept:
            return [], None
        return kept, self._rows([entries[i] for i in kept], [extras[i] for i in kept], device)

    def _extra_columns(self, entry: _Entry, drafted: list[int]) -> _Extra:
        """Where a row's drafted tokens go: +1 on the column of an id the slot holds, or a
        column past the slot's for a new id (one per distinct id)."""
        extra = _Extra()
        columns = entry.column
        for t in drafted:
            if t >= self.vocab_size:
                continue
            col = columns.get(t)
            if col is None:
                col = extra.new.get(t)
            if col is None:
                col = extra.new[t] = len(columns) + len(extra.new)
            extra.counted.append(col)
        return extra

    # ---------------------------------------------------------------- bookkeeping

    def _drop_finished(self) -> None:
        for seq_id, entry in list(self._entries.items()):
            seq = entry.seq()
            if seq is None or seq.is_finished:
                del self._entries[seq_id]
                self._free.append(entry.slot)

    def _absorb(self, seq: Sequence, writes: _Writes) -> _Entry:
        entry = self._entries.get(seq.seq_id)
        if entry is None or not _extends(entry, seq):
            entry = self._fresh(seq, entry, writes)
        tokens, vocab, prompt = seq.token_ids, self.vocab_size, seq.num_prompt_tokens
        column = entry.column
        for i in range(entry.absorbed, len(tokens)):
            t = tokens[i]
            if t >= vocab:
                continue
            col = column.get(t)
            if col is None:
                col = column[t] = len(column)
                writes.new.append((entry.slot, col, t))
            if i >= prompt:
                writes.counted.append((entry.slot, col))
        entry.absorbed = len(tokens)
        return entry

    def _fresh(self, seq: Sequence, old: _Entry | None, writes: _Writes) -> _Entry:
        """An empty slot for seq: its old one if it had one."""
        if old is not None:
            slot = old.slot
        elif self._free:
            slot = self._free.pop()
        else:
            slot, self._num_slots = self._num_slots, self._num_slots + 1
        entry = _Entry(weakref.ref(seq), slot)
        self._entries[seq.seq_id] = entry
        writes.reset.append(slot)
        return entry

    # ---------------------------------------------------------------- tensors

    def _apply(self, writes: _Writes, device: torch.device) -> None:
        ids, counts = self._fit(device)
        long = torch.long
        if writes.reset:
            counts.index_fill_(0, to_device(writes.reset, long, device), 0.0)
        if writes.new:
            slots, cols, tokens = zip(*writes.new)
            ids.index_put_((to_device(slots, long, device), to_device(cols, long, device)),
                           to_device(tokens, long, device))
        if writes.counted:
            slots, cols = zip(*writes.counted)
            counts.index_put_((to_device(slots, long, device), to_device(cols, long, device)),
                              torch.ones(len(slots), device=device), accumulate=True)

    def _use(self, device: torch.device) -> None:
        """Tensors on `device`; on a new device every request is refilled from its history."""
        if self._ids is None or self._ids.device != device:
            self._ids = torch.zeros(0, 0, dtype=torch.long, device=device)
            self._counts = torch.zeros(0, 0, device=device)
            self._entries.clear()
            self._free.clear()
            self._num_slots = 0

    def _fit(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """ids and counts with a row for every slot and a column for every held id: grown by
        doubling, so a step rarely copies them."""
        assert self._ids is not None and self._counts is not None
        width = max((len(e.column) for e in self._entries.values()), default=0)
        have_rows, have_width = self._ids.shape
        if self._num_slots > have_rows or width > have_width:
            rows = _grown(have_rows, self._num_slots, _INITIAL_ROWS)
            cols = _grown(have_width, width, _INITIAL_WIDTH)
            ids = torch.zeros(rows, cols, dtype=torch.long, device=device)
            counts = torch.zeros(rows, cols, device=device)
            ids[:have_rows, :have_width] = self._ids
            counts[:have_rows, :have_width] = self._counts
            self._ids, self._counts = ids, counts
        return self._ids, self._counts

    def _rows(self, entries: list[_Entry], extras: list[_Extra],
              device: torch.device) -> TokenTable:
        """The entries' rows with their drafted tokens, cut to the widest; a shorter row
        repeats its column 0."""
        assert self._ids is not None and self._counts is not None
        lengths = [len(e.column) + len(x.new) for e, x in zip(entries, extras, strict=True)]
        width = max(lengths)
        slots = to_device([e.slot for e in entries], torch.long, device)
        held = min(width, self._ids.shape[1])
        ids = self._ids.index_select(0, slots)[:, :held]  # [p, L]
        counts = self._counts.index_select(0, slots)[:, :held]
        if any(x.counted for x in extras):
            ids, counts = _with_drafts(ids, counts, extras, width, device)
        past_end = (torch.arange(width, device=device)
                    >= to_device(lengths, torch.long, device).unsqueeze(1))  # [p, L]
        return TokenTable(token_ids=torch.where(past_end, ids[:, :1], ids),
                          output_counts=torch.where(past_end, counts[:, :1], counts))


@dataclass(slots=True)
class _Extra:
    """A row's drafted tokens: new ids (id -> column past the slot's) and the column each
    drafted token counts on."""

    new: dict[int, int] = field(default_factory=dict)
    counted: list[int] = field(default_factory=list)


def _with_drafts(ids: torch.Tensor, counts: torch.Tensor, extras: list[_Extra], width: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and counts [p, held] widened to [p, width] with each row's drafted tokens."""
    # ids and counts are index_select's copies: the slots' own rows stay as they are. Their
    # columns past a slot's ids count 0 (a slot's counts are reset when it is taken).
    p, held = ids.shape
    if width > held:
        ids = torch.cat([ids, ids.new_zeros(p, width - held)], dim=1)
        counts = torch.cat([counts, counts.new_zeros(p, width - held)], dim=1)
    long = torch.long
    new = [(i, col, t) for i, x in enumerate(extras) for t, col in x.new.items()]
    if new:
        rows, cols, tokens = zip(*new)
        ids.index_put_((to_device(rows, long, device), to_device(cols, long, device)),
                       to_device(tokens, long, device))
    rows, cols = zip(*((i, col) for i, x in enumerate(extras) for col in x.counted))
    counts.index_put_((to_device(rows, long, device), to_device(cols, long, device)),
                      torch.ones(len(rows), device=device), accumulate=True)
    return ids, counts


def _extends(entry: _Entry, seq: Sequence) -> bool:
    """The slot holds a prefix of this very Sequence's tokens."""
    return entry.seq() is seq and entry.absorbed <= seq.num_tokens


def _grown(have: int, need: int, initial: int) -> int:
    size = max(have, initial)
    while size < need:
        size *= 2
    return size
