"""Sampler: one token per row from one step's logits and its SamplingBatch, batched over rows.

Per row, with vLLM / OpenAI semantics: logit_bias -> min_tokens -> penalties ->
temperature -> top-k -> top-p -> min-p -> draw. Temperature 0 is greedy: the argmax of the
processed logits (truncation cannot move an argmax, so it is skipped). Logprobs always
describe the raw model distribution. Every step works on whole rows and each row's result
depends only on that row, so a request samples the same tokens whatever else is batched.

Everything per row comes in as tensors (engine/sample/sampling_batch.py, built by the runner's
prepare step); nothing here reads a Sequence or turns a Python list into a tensor.
A draw is an inverse-CDF lookup with one uniform per row (not an exponential race: on CPU
drawing V exponentials per row costs ~60 ms for 64 x 49152, the CDF lookup ~2 ms; neither
syncs).

One buffer. A sampled step makes one float32 [rows, vocab] buffer, from the first step that
has to write (the processors' copy, the division by the temperature, or the softmax) and
every later step writes into it: the softmax and the CDF in place, top-p over its candidates
(engine/sample/nucleus.py). A step where every row samples gathers no rows. (It made four to
six such buffers: the float copy, the processors' clone, the sampled rows' gather, the
softmax, top-p's zero-filled scatter target, the CDF.) The arithmetic of every value is
unchanged, so a seeded row draws the tokens it drew before (tests/engine/test_sampler_pinned.py)
except where top-p's cut falls inside a run of equal probabilities (see nucleus.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.sample.nucleus import FLOORS, apply_top_p, nucleus_sample
from engine.sample.sampling_batch import Penalties, RowParam, SamplingBatch
from engine.worker.runner_output import TokenLogprobIds

# ----------------------------------------------------------------------------------------
# Processing steps: each works on [n, V] rows in place and is testable on its own.


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """In place on logits [n, V]: row penalties.rows[i] by its own prompt/output tokens.

    repetition (HF/vLLM) covers prompt + output: a seen token's logit > 0 is divided by it,
    one < 0 multiplied. presence/frequency (OpenAI) cover output only:
    logit -= presence * (count > 0) + frequency * count. Only the seen (row, token) pairs
    are touched, so the cost follows the token count, not n * V."""
    pen, table = penalties, penalties.tokens
    rows = pen.rows.unsqueeze(1)  # [p, 1]
    ids, counts = table.token_ids, table.output_counts  # [p, L]
    vals = logits[rows, ids]  # [p, L]
    r = pen.repetition.unsqueeze(1)
    vals = torch.where(vals > 0, vals / r, vals * r)
    cut = pen.presence.unsqueeze(1) + pen.frequency.unsqueeze(1) * counts
    # A row's padding repeats one of its pairs: the same value is written twice
    logits[rows, ids] = torch.where(counts > 0, vals - cut, vals)
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    """In place on logits [n, V]: keep each row's top_k[i] best (ties at the cut stay);
    top_k [n] long, k_max its largest value."""
    best = logits.topk(k_max, dim=-1).values  # [n, kmax], best first
    threshold = best.gather(1, top_k.unsqueeze(1) - 1)  # [n, 1]
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place on probs [n, V]: drop tokens with p < min_p[i] * max p (min_p [n])."""
    scale = min_p.unsqueeze(1)  # [n, 1]
    threshold = probs.amax(dim=-1, keepdim=True) * scale
    return probs.masked_fill_(probs < threshold, 0.0)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over probs [n, V] (>= 0, need not sum to 1; overwritten by its CDF)
    with uniforms [n] in [0, 1). A zero-probability token owns an empty CDF interval, so it is
    never drawn."""
    cdf = probs.cumsum_(-1)  # [n, V], non-decreasing
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


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words [c, W] -> bool [c, vocab_size]: token t is bit t % 32 of word t // 32."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [c, W, 32]; sign bits masked off by & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


# ----------------------------------------------------------------------------------------
# The batched sampler. "Owned" below: a float32 buffer of this call's, free to overwrite;
# the caller's logits never are (the runner samples them again, row by row, after a failure).


def sample(logits: torch.Tensor,
           batch: SamplingBatch) -> tuple[list[int], list[TokenLogprobIds | None]]:
    """logits [num_rows, >= vocab] -> one token (and optional logprobs) per row."""
    assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, (logits.shape,
                                                                     batch.num_rows)
    assert logits.shape[1] >= batch.vocab_size, (logits.shape, batch.vocab_size)
    rows = logits[:, : batch.vocab_size]  # a padded LM head's tail is cut
    if _plain_greedy(batch):
        # The max of the model's own dtype: widening bf16 to fp32 is exact, so the same first
        # index of the max, without the [n, V] fp32 copy (64 x 49152: ~1.3 ms on the CPU).
        return rows.max(dim=-1).indices.tolist(), [None] * batch.num_rows
    raw_logprobs = _raw_logprobs(rows, batch)
    if _has_processors(batch):
        tokens = _choose(_processed(rows, batch), batch, owned=True)
    else:
        tokens = _choose(rows, batch, owned=False)
    return tokens.tolist(), _logprobs(raw_logprobs, tokens, batch)


def _plain_greedy(batch: SamplingBatch) -> bool:
    """Every row greedy, nothing that changes the logits, no logprobs: an argmax."""
    return batch.sampled is None and batch.logprob_index is None and not _has_processors(batch)


def _has_processors(batch: SamplingBatch) -> bool:
    """Anything that changes logits before the choice (what _processed applies)."""
    return not (batch.bias is None and batch.banned is None and batch.penalties is None
                and batch.allowed is None)


def _owned(x: torch.Tensor) -> torch.Tensor:
    return x.clone() if x.dtype == torch.float32 else x.float()


def _processed(rows: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """grammar mask -> logit_bias -> min_tokens -> penalties, on the step's float32 copy.
    The mask comes first: nothing after it can bring back a forbidden token."""
    logits = _owned(rows)  # [n, V]
    if batch.allowed is not None:
        index, bitmask = batch.allowed
        forbidden = ~unpack_bitmask(bitmask, logits.shape[1])  # [c, V]
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(
            forbidden, float("-inf")))
    if batch.bias is not None:
        index, cols, vals = batch.bias
        logits.index_put_((index, cols), vals, accumulate=True)
    if batch.banned is not None:
        index, cols = batch.banned
        logits[index, cols] = float("-inf")
    if batch.penalties is not None:
        apply_penalties(logits, batch.penalties)
    return logits


def _choose(logits: torch.Tensor, batch: SamplingBatch, owned: bool) -> torch.Tensor:
    """Greedy rows: argmax (an all-greedy step costs one argmax). Others: a draw; when every
    row is drawn, from logits itself (no gather)."""
    if batch.sampled is None:
        # max(dim).indices: the same first index of the max as argmax, 2.7x faster on the
        # CPU (64 x 49152 fp32: 0.86 ms against 2.3)
        return logits.max(dim=-1).indices
    if batch.num_sampled == logits.shape[0]:
        return _draw(logits, batch, owned)
    tokens = logits.max(dim=-1).indices  # [n]; sampled rows are overwritten below
    drawn = logits.index_select(0, batch.sampled)  # a new tensor: ours if float32
    tokens.index_copy_(0, batch.sampled, _draw(drawn, batch, drawn.dtype == torch.float32))
    return tokens


def _draw(logits: torch.Tensor, batch: SamplingBatch, owned: bool) -> torch.Tensor:
    """logits [s, V] of the sampled rows -> [s] tokens: temperature, top-k, softmax, then
    top-p, min-p and the draw (_draw_probs)."""
    assert batch.temperature is not None and batch.uniforms is not None
    if not batch.unit_temperature:  # x / 1 is x: skipped when every row has temperature 1
        t = batch.temperature.unsqueeze(1)
        logits = logits.div_(t) if owned else torch.div(logits, t)  # bf16 / fp32: fp32
        owned = True
    if batch.top_k is not None:
        logits = logits if owned else _owned(logits)
        owned = True
        k_max = batch.top_k_max
        _on_rows(lambda x, k: apply_top_k(x, k, k_max), logits, batch.top_k)
    return _draw_probs(_softmax(logits, owned), batch)


def _softmax(logits: torch.Tensor, owned: bool) -> torch.Tensor:
    """float32 probabilities, in place where the buffer is ours (on the CPU: the in-place form
    of a GPU kernel is not promised). A bf16 input is widened first: softmax(dtype=float32)
    would widen into one buffer and write into a second."""
    on_cpu = logits.device.type == "cpu"
    if not owned and (logits.dtype == torch.float32 or not on_cpu):
        return logits.softmax(-1, dtype=torch.float32)
    if not owned:
        logits = logits.float()
    return torch.softmax(logits, -1, out=logits) if on_cpu else logits.softmax(-1)


def _draw_probs(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """probs [s, V] (ours) -> [s] tokens. Top-p rows go through their candidates (the ones
    that settle there); every other row through min-p and a draw over its whole row."""
    uniforms = batch.uniforms
    assert uniforms is not None
    min_p = _dense(batch.min_p, probs.shape[0], probs)
    top_p = batch.top_p
    if top_p is None:
        return _draw_rows(probs, None, min_p, uniforms)
    index = top_p.rows  # None: every row
    if index is None:
        return _draw_top_p(probs, top_p.values, min_p, uniforms)
    tokens = _draw_top_p(probs.index_select(0, index), top_p.values, _pick(min_p, index),
                         uniforms[index])
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    others = torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
    others[index] = False
    rest = others.nonzero().squeeze(1)
    out.index_copy_(0, index, tokens)
    if rest.numel():
        out.index_copy_(0, rest, _draw_rows(probs.index_select(0, rest), None,
                                            _pick(min_p, rest), uniforms[rest]))
    return out


def _draw_top_p(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None,
                uniforms: torch.Tensor) -> torch.Tensor:
    """Every row of probs [r, V] has a top_p: drawn over its candidates, with a lower floor
    for the rows whose candidates hold too little mass, and over the whole row after
    apply_top_p for the few that still do (very flat rows)."""
    tokens, settled = nucleus_sample(probs, top_p, min_p, uniforms, FLOORS[0])
    left = (~settled).nonzero().squeeze(1)  # [f] rows of probs not settled yet
    for floor in FLOORS[1:]:
        if not left.numel():
            return tokens
        found, settled = nucleus_sample(probs.index_select(0, left), top_p[left],
                                        _pick(min_p, left), uniforms[left], floor)
        tokens.index_copy_(0, left[settled], found[settled])
        left = left[~settled]
    if left.numel():
        tokens.index_copy_(0, left, _draw_rows(probs.index_select(0, left), top_p[left],
                                               _pick(min_p, left), uniforms[left]))
    return tokens


def _draw_rows(probs: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
               uniforms: torch.Tensor) -> torch.Tensor:
    """Top-p (if given), min-p (if given), then the draw, each over whole rows of probs."""
    if top_p is not None:
        apply_top_p(probs, top_p)
    if min_p is not None:  # rows without min_p carry 0: p < 0 drops nothing
        apply_min_p(probs, min_p)
    return sample_from_probs(probs, uniforms)


def _dense(param: RowParam | None, n: int, like: torch.Tensor) -> torch.Tensor | None:
    """A RowParam as [n] values (0 for the rows that did not set it); None if no row did."""
    if param is None or param.rows is None:
        return None if param is None else param.values
    return torch.zeros(n, dtype=param.values.dtype, device=like.device).index_copy_(
        0, param.rows, param.values)


def _pick(values: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
    if values is None or index is None:
        return values
    return values.index_select(0, index)


def _raw_logprobs(rows: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
    """The asked rows' log-softmax of the raw logits [l, V], before anything is written."""
    if batch.logprob_index is None:
        return None
    return rows.index_select(0, batch.logprob_index).float().log_softmax(-1)


def _logprobs(raw: torch.Tensor | None, tokens: torch.Tensor,
              batch: SamplingBatch) -> list[TokenLogprobIds | None]:
    out: list[TokenLogprobIds | None] = [None] * batch.num_rows
    if raw is not None and batch.logprob_index is not None:
        chosen = tokens.index_select(0, batch.logprob_index)
        found = token_logprobs(raw, chosen, list(batch.logprob_top_n))
        for row, entry in zip(batch.logprob_rows, found):
            out[row] = entry
    return out


_Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _on_rows(step: _Step, x: torch.Tensor, param: RowParam) -> None:
    """Apply step(x[rows], values) in place, touching only the rows that asked for it."""
    if param.rows is None:  # every row asked
        step(x, param.values)
        return
    x.index_copy_(0, param.rows, step(x.index_select(0, param.rows), param.values))
