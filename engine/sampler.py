"""Sampler: one token per sequence from one step's logits, batched over rows.

Per row, with vLLM / OpenAI semantics: logit_bias -> min_tokens -> penalties ->
temperature -> top-k -> top-p -> min-p -> draw. Temperature 0 is greedy: the argmax of the
processed logits (truncation cannot move an argmax, so it is skipped). Logprobs always
describe the raw model distribution. Every step works on whole rows and each row's result
depends only on that row, so a request samples the same tokens whatever else is batched.

Randomness: a draw is an inverse-CDF lookup with one uniform per row. A seeded row takes
its uniform from a hash of (seed, number of output tokens so far), so its tokens do not
depend on the batch, the step it lands in, preemption, or the device; unseeded rows take
theirs from the sampler's own generator. (Not an exponential race: on CPU drawing V
exponentials per row costs ~60 ms for 64 x 49152, the CDF lookup ~2 ms; neither syncs.)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from itertools import chain

import torch

from engine.runner_output import TokenLogprobIds
from scheduler.sequence import Sequence

_MASK64 = (1 << 64) - 1
_MIN_TEMPERATURE = 1e-5  # below this, logits / T overflows: treat as greedy, as vLLM does
_TOP_P_CANDIDATES = 256  # top-p looks at this many best tokens before falling back to a sort


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) that is a pure function of (request seed, output position)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ step) >> 11) * 2.0**-53


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The one place Python lists become device tensors (pinned + async on CUDA)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _long(values: Iterable[int], device: torch.device) -> torch.Tensor:
    return _tensor(list(values), torch.long, device)


# ----------------------------------------------------------------------------------------
# Processing steps: each works on [n, V] rows in place and is testable on its own.


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]],
                    output_ids: list[list[int]], repetition: list[float],
                    presence: list[float], frequency: list[float]) -> torch.Tensor:
    """In place on logits [n, V]; row i is penalised by its own prompt/output token ids.

    repetition (HF/vLLM) covers prompt + output: a seen token's logit > 0 is divided by it,
    one < 0 multiplied. presence/frequency (OpenAI) cover output only:
    logit -= presence * (count > 0) + frequency * count. Only the seen (row, token) pairs
    are touched, so the cost follows the token count, not n * V."""
    device = logits.device
    rep, pres, freq = (_tensor(v, torch.float32, device) for v in (repetition, presence, frequency))
    rows, ids, _ = _distinct_tokens([p + o for p, o in zip(prompt_ids, output_ids)], logits)
    if rows.numel():
        vals, r = logits[rows, ids], rep[rows]
        logits[rows, ids] = torch.where(vals > 0, vals / r, vals * r)
    rows, ids, counts = _distinct_tokens(output_ids, logits)
    if rows.numel():
        logits[rows, ids] -= pres[rows] + freq[rows] * counts
    return logits


def _distinct_tokens(token_lists: list[list[int]],
                     logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token id) pairs of the lists and how often each occurs, each [k].
    Ids past the LM head (an embedding larger than the head) are skipped, as HF does."""
    vocab = logits.shape[1]
    ids = _long(chain.from_iterable(token_lists), logits.device)  # [total]
    rows = _long(chain.from_iterable([r] * len(t) for r, t in enumerate(token_lists)),
                 logits.device)
    keys = (rows * vocab + ids)[ids < vocab]
    keys, counts = torch.unique(keys, return_counts=True)  # [k]
    return keys // vocab, keys % vocab, counts.to(logits.dtype)


def apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """In place on logits [n, V]: keep each row's top_k[i] best (ties at the cut stay)."""
    best = logits.topk(max(top_k), dim=-1).values  # [n, kmax], best first
    k = _tensor(top_k, torch.long, logits.device).unsqueeze(1)  # [n, 1]
    threshold = best.gather(1, k - 1)  # [n, 1]
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_p(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Nucleus on probs [n, V] (zeros elsewhere): keep the best tokens until their mass
    reaches top_p[i]. Most rows are settled by the best few hundred tokens; only rows whose
    nucleus is wider pay for a full sort (113 ms for 64 x 49152 on CPU)."""
    p = _tensor(top_p, probs.dtype, probs.device).unsqueeze(1)  # [n, 1]
    k = min(_TOP_P_CANDIDATES, probs.shape[1])
    vals, ids = probs.topk(k, dim=-1)  # [n, k], best first
    cum = vals.cumsum(-1)
    out = torch.zeros_like(probs).scatter_(1, ids, vals * ((cum - vals) < p))
    if k < probs.shape[1]:
        wide = (cum[:, -1] < p[:, 0]).nonzero().squeeze(1)  # [w] rows not settled
        if wide.numel():
            out.index_copy_(0, wide, _top_p_sorted(probs.index_select(0, wide), p[wide]))
    return probs.copy_(out)


def _top_p_sorted(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    vals, ids = probs.sort(dim=-1, descending=True)  # [n, V]
    keep = (vals.cumsum(-1) - vals) < p  # mass before the token has not yet reached p
    return torch.zeros_like(probs).scatter_(1, ids, vals * keep)


def apply_min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """In place on probs [n, V]: drop tokens with p < min_p[i] * max p."""
    scale = _tensor(min_p, probs.dtype, probs.device).unsqueeze(1)  # [n, 1]
    threshold = probs.amax(dim=-1, keepdim=True) * scale
    return probs.masked_fill_(probs < threshold, 0.0)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over probs [n, V] (>= 0, need not sum to 1) with uniforms [n] in
    [0, 1). A zero-probability token owns an empty CDF interval, so it is never drawn."""
    cdf = probs.cumsum(-1)  # [n, V], non-decreasing
    total = cdf[:, -1:]  # [n, 1]
    below_total = torch.nextafter(total, torch.zeros_like(total))  # keeps x inside the CDF
    x = torch.minimum(uniforms.unsqueeze(1) * total, below_total)  # [n, 1]
    return torch.searchsorted(cdf, x, right=True).squeeze(1)  # [n]


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                   top_ns: list[int]) -> list[TokenLogprobIds]:
    """Row i: the logprob and rank of token_ids[i] plus the top_ns[i] best, from logprobs [n, V]."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    top_n = max(top_ns, default=0)
    top_vals, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (chosen[:, :0], chosen[:, :0])
    rows = zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks, top_ids.tolist(),
               top_vals.tolist(), top_ns)
    return [TokenLogprobIds(t, lp, r, tuple(ids[:n]), tuple(vals[:n]))
            for t, lp, r, ids, vals, n in rows]


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            top_n: int) -> list[TokenLogprobIds]:
    """logits [n, V] at n prompt positions, target_ids [n] the token that follows each."""
    logprobs = logits.float().log_softmax(-1)
    return token_logprobs(logprobs, target_ids.to(logits.device), [top_n] * logits.shape[0])


# ----------------------------------------------------------------------------------------
# The batched sampler.


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
    """What one call needs from the Python side, gathered in one pass over the sequences.
    Rows in temperature/top_k/top_p/min_p/uniforms index the sampled sub-batch."""

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


class Sampler:
    """Turns one step's logits [num_seqs, V] into one token (and optional logprobs) per row."""

    def __init__(self, vocab_size: int, eos_token_ids: Collection[int] = (),
                 seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self._rng = random.Random(seed)  # unseeded rows; None seeds from OS entropy

    def __call__(self, logits: torch.Tensor,
                 seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobIds | None]]:
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        assert logits.shape[1] >= self.vocab_size, (logits.shape, self.vocab_size)
        raw = logits[:, : self.vocab_size].float()  # [n, V]; a padded LM head's tail is cut
        plan = self._plan(seqs)
        processed = self._process(raw, seqs, plan)
        tokens = self._choose(processed, plan)  # [n]
        return tokens.tolist(), self._logprobs(raw, tokens, plan, len(seqs))

    def _plan(self, seqs: list[Sequence]) -> _Plan:
        plan = _Plan()
        for row, seq in enumerate(seqs):
            params = seq.params
            if params.temperature >= _MIN_TEMPERATURE:
                self._plan_sampled(plan, row, seq)
            plan.bias.extend((row, t, b) for t, b in params.logit_bias.items()
                             if t < self.vocab_size)
            if seq.num_output_tokens < params.min_tokens:
                plan.banned.extend((row, t) for t in self._stop_ids(seq))
            if params.needs_penalties:
                plan.penalised.append(row)
            if params.logprobs is not None:
                plan.logprobs.add(row, params.logprobs)
        return plan

    def _plan_sampled(self, plan: _Plan, row: int, seq: Sequence) -> None:
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
                             else seeded_uniform(seed, seq.num_output_tokens))

    def _stop_ids(self, seq: Sequence) -> set[int]:
        """Tokens min_tokens forbids: stop_token_ids, and EOS unless EOS is ignored."""
        ids = {t for t in seq.params.stop_token_ids if t < self.vocab_size}
        return ids if seq.params.ignore_eos else ids.union(self.eos_token_ids)

    def _process(self, raw: torch.Tensor, seqs: list[Sequence], plan: _Plan) -> torch.Tensor:
        """logit_bias -> min_tokens -> penalties, on a copy; raw is kept for logprobs."""
        if not (plan.bias or plan.banned or plan.penalised):
            return raw
        logits = raw.clone()
        if plan.bias:
            rows, cols, vals = zip(*plan.bias)
            index = (_long(rows, raw.device), _long(cols, raw.device))
            logits.index_put_(index, _tensor(list(vals), torch.float32, raw.device),
                              accumulate=True)
        if plan.banned:
            rows, cols = zip(*plan.banned)
            logits[_long(rows, raw.device), _long(cols, raw.device)] = float("-inf")
        if plan.penalised:
            self._penalise(logits, [seqs[r] for r in plan.penalised], plan.penalised)
        return logits

    def _penalise(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        index = _long(rows, logits.device)
        params = [s.params for s in seqs]
        penalised = apply_penalties(
            logits.index_select(0, index),
            [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
            [p.repetition_penalty for p in params], [p.presence_penalty for p in params],
            [p.frequency_penalty for p in params])
        logits.index_copy_(0, index, penalised)

    def _choose(self, logits: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """Greedy rows: argmax (an all-greedy step costs one argmax). Others: a draw."""
        if len(plan.sampled) < logits.shape[0]:
            tokens = logits.argmax(dim=-1)  # [n]; sampled rows are overwritten below
        else:
            tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if plan.sampled:
            index = _tensor(plan.sampled, torch.long, logits.device)
            tokens.index_copy_(0, index, self._draw(logits.index_select(0, index), plan))
        return tokens

    def _draw(self, logits: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """logits [s, V] of the sampled rows (a private copy) -> [s] tokens."""
        device = logits.device
        logits.div_(_tensor(plan.temperature, torch.float32, device).unsqueeze(1))
        if plan.top_k.rows:
            _on_rows(apply_top_k, logits, plan.top_k)
        probs = logits.softmax(dim=-1)  # [s, V]
        if plan.top_p.rows:
            _on_rows(apply_top_p, probs, plan.top_p)
        if plan.min_p.rows:
            _on_rows(apply_min_p, probs, plan.min_p)
        return sample_from_probs(probs, _tensor(plan.uniforms, torch.float32, device))

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, plan: _Plan,
                  n: int) -> list[TokenLogprobIds | None]:
        out: list[TokenLogprobIds | None] = [None] * n
        if plan.logprobs.rows:
            index = _tensor(plan.logprobs.rows, torch.long, raw.device)
            chosen = tokens.index_select(0, index)
            found = token_logprobs(raw.index_select(0, index).log_softmax(-1), chosen,
                                   plan.logprobs.values)
            for row, entry in zip(plan.logprobs.rows, found):
                out[row] = entry
        return out


_Step = Callable[[torch.Tensor, list], torch.Tensor]


def _on_rows(step: _Step, x: torch.Tensor, subset: _Rows) -> None:
    """Apply step(x[rows], values) in place, touching only the rows that asked for it."""
    if len(subset.rows) == x.shape[0]:  # rows are 0..s-1 in order: every row asked
        step(x, subset.values)
        return
    index = _tensor(subset.rows, torch.long, x.device)
    x.index_copy_(0, index, step(x.index_select(0, index), subset.values))
