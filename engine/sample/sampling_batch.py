"""SamplingBatch: one step's sampling inputs as device tensors, built in the runner's prepare.

The sampler (engine/sample/sampler.py) is a function of (logits, SamplingBatch) and never sees a
Sequence: `SamplingBatchBuilder.build` reads the sampled sequences' SamplingParams and
progress in one pass and turns what it found into tensors through `step_tensors.to_device`,
like every other input of the step. Rows that need nothing special cost nothing: an
all-greedy step builds no tensor at all.

Randomness is an input too: a seeded row's uniform is a pure function of (seed, number of
output tokens so far), so its tokens do not depend on the batch, the step it lands in,
preemption or the device; unseeded rows take theirs from the builder's own generator.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

import torch

from engine.sample.penalty_state import PenaltyState, TokenTable
from engine.worker.step_tensors import to_device
from scheduler import stop_policy
from scheduler.sequence import Sequence

_MASK64 = (1 << 64) - 1
MIN_TEMPERATURE = 1e-5  # below this, logits / T overflows: treat as greedy, as vLLM does


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) that is a pure function of (request seed, output position)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ step) >> 11) * 2.0**-53


@dataclass(frozen=True, slots=True, eq=False)
class GrammarMasks:
    """One step's allowed tokens (engine/structured_output/manager.py fills them): bitmask row i, int32
    words on the CPU, for sequence seq_ids[i] at offsets[i] tokens past its output (a drafting
    sequence has a row per position it scores, 0..k; empty offsets: every row at 0)."""

    seq_ids: tuple[str, ...]
    bitmask: torch.Tensor  # [c, ceil(V / 32)] int32
    offsets: tuple[int, ...] = ()

    def index(self) -> dict[tuple[str, int], int]:
        """(sequence id, offset) -> its bitmask row."""
        offsets = self.offsets or (0,) * len(self.seq_ids)
        return {key: i for i, key in enumerate(zip(self.seq_ids, offsets, strict=True))}


@dataclass(frozen=True, slots=True, eq=False)
class RowParam:
    """A parameter only some rows set: values [r] for rows [r] of the sub-batch it applies to
    (rows None: every row, in order, so no gather is needed)."""

    rows: torch.Tensor | None
    values: torch.Tensor  # [r]


@dataclass(frozen=True, slots=True, eq=False)
class Penalties:
    """Repetition / presence / frequency penalties of the rows that have any."""

    rows: torch.Tensor  # [p] batch rows with a penalty
    repetition: torch.Tensor  # [p] float32
    presence: torch.Tensor  # [p] float32
    frequency: torch.Tensor  # [p] float32
    tokens: TokenTable  # [p, L] each row's distinct prompt + output ids, their output counts


def build_penalties(rows: list[int], prompt_ids: list[list[int]], output_ids: list[list[int]],
                    repetition: list[float], presence: list[float], frequency: list[float],
                    device: torch.device, vocab_size: int) -> Penalties:
    """Penalties rebuilt from whole histories (what PenaltyState keeps step by step, and the
    reference its tests compare with). Ids >= vocab_size are skipped, as HF skips ids past
    the LM head; every row needs one id below it."""
    seen = [[t for t in dict.fromkeys(p + o) if t < vocab_size]
            for p, o in zip(prompt_ids, output_ids)]
    counted = [Counter(o) for o in output_ids]
    width = max(map(len, seen), default=0)
    ids = [s + s[:1] * (width - len(s)) for s in seen]  # padding repeats the first pair
    counts = [[float(c[t]) for t in row] for row, c in zip(ids, counted)]
    f32 = torch.float32
    return Penalties(rows=to_device(rows, torch.long, device),
                     repetition=to_device(repetition, f32, device),
                     presence=to_device(presence, f32, device),
                     frequency=to_device(frequency, f32, device),
                     tokens=TokenTable(to_device(ids, torch.long, device),
                                       to_device(counts, f32, device)))


@dataclass(frozen=True, slots=True, eq=False)
class SamplingBatch:
    """Rows are the step's sampling sequences in batch order. Rows with temperature 0 are
    greedy; the others ("sampled", s of them) are drawn, and the RowParams of the draw
    (top_k, top_p, min_p) index the sampled sub-batch 0..s-1."""

    num_rows: int
    vocab_size: int  # logits columns past it (a padded LM head) are cut off
    sampled: torch.Tensor | None  # [s] rows drawn at random; None when every row is greedy
    temperature: torch.Tensor | None  # [s] float32
    uniforms: torch.Tensor | None  # [s] float32, one draw each
    top_k: RowParam | None
    top_k_max: int  # the largest top_k value (a Python int: topk needs it without a sync)
    top_p: RowParam | None
    min_p: RowParam | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, bias)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) min_tokens forbids
    penalties: Penalties | None
    logprob_rows: tuple[int, ...]  # rows that report logprobs (where their results go)
    logprob_index: torch.Tensor | None  # [l] the same rows
    logprob_top_n: tuple[int, ...]  # [l] top-N alternatives each
    # Structured outputs: (rows [c], int32 bitmask [c, ceil(V / 32)]) of the constrained
    # rows; token t allowed iff bit t % 32 of word t // 32 is set (engine/structured_output/grammar.py).
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    unit_temperature: bool = False  # every sampled row has temperature 1: no division needed

    @property
    def num_sampled(self) -> int:
        return 0 if self.sampled is None else self.sampled.shape[0]


@dataclass(slots=True)
class _Rows:
    """Some rows of a batch and one value per row."""

    rows: list[int] = field(default_factory=list)
    values: list = field(default_factory=list)

    def add(self, row: int, value: object) -> None:
        self.rows.append(row)
        self.values.append(value)


@dataclass(slots=True)
class _Plan:
    """What the Python side found, gathered in one pass over the sequences. Rows in
    temperature/top_k/top_p/min_p/uniforms index the sampled sub-batch."""

    sampled: list[int] = field(default_factory=list)  # batch rows drawn at random
    bias: list[tuple[int, int, float]] = field(default_factory=list)  # (row, token, bias)
    banned: list[tuple[int, int]] = field(default_factory=list)  # (row, token) for min_tokens
    penalised: list[int] = field(default_factory=list)
    logprobs: _Rows = field(default_factory=_Rows)  # value: top-N
    temperature: list[float] = field(default_factory=list)
    top_k: _Rows = field(default_factory=_Rows)
    top_p: _Rows = field(default_factory=_Rows)
    min_p: _Rows = field(default_factory=_Rows)
    uniforms: list[float] = field(default_factory=list)


class SamplingBatchBuilder:
    """Builds a step's SamplingBatch from its sampling sequences (the runner's one place)."""

    def __init__(self, vocab_size: int, eos_token_ids: Collection[int] = (),
                 seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self._rng = random.Random(seed)  # unseeded rows; None seeds from OS entropy
        self._penalty_state = PenaltyState(vocab_size)  # penalised requests' token counts

    def build(self, seqs: list[Sequence], device: torch.device,
              masks: GrammarMasks | None = None,
              offsets: list[int] | None = None,
              drafts: Mapping[str, list[int]] | None = None) -> SamplingBatch:
        """`masks`: the step's grammar bitmasks, by sequence id (only constrained ones).
        `offsets`: per row, how many tokens past the sequence's output it draws (a drafting
        sequence is in `seqs` once per position it scores, 0..k); None: all 0. `drafts`: the
        drafting sequences' drafts; a row at offset j counts the first j in its penalties."""
        offsets = offsets or [0] * len(seqs)
        constrained = set() if masks is None else set(masks.seq_ids)
        plan = self._plan(seqs, constrained, offsets)
        batch = self._to_batch(plan, seqs, device, offsets, drafts or {})
        if masks is None or not constrained:
            return batch
        return replace(batch, allowed=self._allowed(seqs, offsets, masks, device))

    def _plan(self, seqs: list[Sequence], constrained: Collection[str],
              offsets: list[int]) -> _Plan:
        plan = _Plan()
        for row, (seq, offset) in enumerate(zip(seqs, offsets, strict=True)):
            params = seq.params
            if params.temperature >= MIN_TEMPERATURE:
                self._plan_sampled(plan, row, seq, seq.num_output_tokens + offset)
            plan.bias.extend((row, t, b) for t, b in params.logit_bias.items()
                             if t < self.vocab_size)
            # A grammar decides where EOS may go (banning it could leave no token at all);
            # the engine finishes the sequence when the grammar ends.
            if not stop_policy.may_stop(seq) and seq.seq_id not in constrained:
                plan.banned.extend((row, t) for t in self._stop_ids(seq))
            if params.needs_penalties:
                plan.penalised.append(row)
            if params.logprobs is not None:
                plan.logprobs.add(row, params.logprobs)
        return plan

    def _plan_sampled(self, plan: _Plan, row: int, seq: Sequence, position: int) -> None:
        params, pos = seq.params, len(plan.sampled)
        plan.sampled.append(row)
        plan.temperature.append(params.temperature)
        if 0 < params.top_k < self.vocab_size:
            plan.top_k.add(pos, params.top_k)
        if params.top_p < 1.0:
            plan.top_p.add(pos, params.top_p)
        if params.min_p > 0.0:
            plan.min_p.add(pos, params.min_p)
        seed = params.seed
        plan.uniforms.append(self._rng.random() if seed is None
                             else seeded_uniform(seed, position))

    def _stop_ids(self, seq: Sequence) -> set[int]:
        """Tokens min_tokens forbids (stop_policy.stop_tokens), those in the vocabulary."""
        return {t for t in stop_policy.stop_tokens(seq.params, self.eos_token_ids)
                if t < self.vocab_size}

    def _to_batch(self, plan: _Plan, seqs: list[Sequence], device: torch.device,
                  offsets: list[int], drafts: Mapping[str, list[int]]) -> SamplingBatch:
        f32, long = torch.float32, torch.long
        s = len(plan.sampled)

        def opt(values: list, dtype: torch.dtype) -> torch.Tensor | None:
            return to_device(values, dtype, device) if values else None

        def row_param(subset: _Rows, dtype: torch.dtype) -> RowParam | None:
            if not subset.rows:
                return None
            rows = None if len(subset.rows) == s else to_device(subset.rows, long, device)
            return RowParam(rows, to_device(subset.values, dtype, device))

        return SamplingBatch(
            num_rows=len(seqs), vocab_size=self.vocab_size, sampled=opt(plan.sampled, long),
            temperature=opt(plan.temperature, f32), uniforms=opt(plan.uniforms, f32),
            top_k=row_param(plan.top_k, long), top_k_max=max(plan.top_k.values, default=0),
            top_p=row_param(plan.top_p, f32), min_p=row_param(plan.min_p, f32),
            bias=self._bias(plan, device), banned=self._banned(plan, device),
            penalties=self._penalties(plan, seqs, device, offsets, drafts),
            logprob_rows=tuple(plan.logprobs.rows), logprob_index=opt(plan.logprobs.rows, long),
            logprob_top_n=tuple(plan.logprobs.values),
            unit_temperature=bool(plan.temperature) and all(t == 1.0 for t in plan.temperature))

    @staticmethod
    def _allowed(seqs: list[Sequence], offsets: list[int], masks: GrammarMasks,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        index = masks.index()
        keys = [(seq.seq_id, offset) for seq, offset in zip(seqs, offsets, strict=True)]
        rows = [r for r, key in enumerate(keys) if key in index]
        order = [index[keys[r]] for r in rows]
        bitmask = masks.bitmask[order] if order != list(range(len(order))) else masks.bitmask
        return (to_device(rows, torch.long, device),
                bitmask.to(device, non_blocking=device.type == "cuda"))

    @staticmethod
    def _bias(plan: _Plan,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if not plan.bias:
            return None
        rows, cols, vals = zip(*plan.bias)
        return (to_device(rows, torch.long, device), to_device(cols, torch.long, device),
                to_device(vals, torch.float32, device))

    @staticmethod
    def _banned(plan: _Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not plan.banned:
            return None
        rows, cols = zip(*plan.banned)
        return to_device(rows, torch.long, device), to_device(cols, torch.long, device)

    def _penalties(self, plan: _Plan, seqs: list[Sequence], device: torch.device,
                   offsets: list[int], drafts: Mapping[str, list[int]]) -> Penalties | None:
        """The penalised rows' parameters, and their tokens from the incremental counts
        (engine/sample/penalty_state.py), with a drafting row's drafts before its position.
        A row none of whose ids is in the vocabulary has nothing to penalise and is left
        out."""
        if not plan.penalised:
            return None
        drafted = [drafts.get(seqs[r].seq_id, [])[:offsets[r]] for r in plan.penalised]
        kept, table = self._penalty_state.table([seqs[r] for r in plan.penalised], device,
                                                drafted)
        if table is None:
            return None
        rows = [plan.penalised[i] for i in kept]
        params = [seqs[r].params for r in rows]
        f32 = torch.float32
        return Penalties(
            rows=to_device(rows, torch.long, device),
            repetition=to_device([p.repetition_penalty for p in params], f32, device),
            presence=to_device([p.presence_penalty for p in params], f32, device),
            frequency=to_device([p.frequency_penalty for p in params], f32, device),
            tokens=table)
