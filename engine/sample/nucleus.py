"""Top-p (nucleus) and the draw that follows it, over the few tokens that can be in a nucleus.

What it replaces: top-p took each row's 256 best with topk (a partial sort of every row: 9.6 ms
for 64 x 49152 on one core), sorted the whole row where those 256 held less than top_p (1.8 ms
a row; half of SmolLM2-135M's rows at temperature 1), zero-filled a new [n, V] buffer to
scatter the kept mass into, and drew from a cumulative sum of the whole row.

Here a row's candidates are its tokens with p >= a floor (FLOORS[0]: one compare and one
nonzero over the rows); only they are sorted, and the draw searches the kept ones. A row whose
candidates hold less than top_p (a flat distribution) is not settled: the caller tries it
again with the next floor, then gives it to `apply_top_p`, the full-row version of the same
rule, and draws over its whole row.

Exactness (the same kept set and token as the full-row rule, bit for bit):
- The full rule's running mass at the j-th best token is float32(D_j), D_j its running sum in
  double (torch's CPU cumsum accumulates float32 in double). With a floor of 2^e every candidate
  is a multiple of 2^(e-23), and so is every sum of them; while such sums stay below 2^(30+e)
  (n rows of mass 1: n < 2^(29+e)) they fit a double's 53 bits and are exact whatever the order
  of the additions. One cumsum over all candidates, minus the sum before each row, gives every
  row's exact D_j.
- A non-candidate is never kept when the row is settled: its preceding mass is at least the
  candidates' mass, which is >= top_p + the floor.
- The draw: an inverse CDF in vocabulary order, whose dropped tokens add zeros: the kept
  tokens have the same CDF values whether the zeros are there or not.
Ties at the cut: tokens of the same probability as the last kept one are all kept (as top-k
keeps ties at its cut). The topk/sort version kept an arbitrary part of them (whatever order
std::partial_sort or std::sort left them in over the whole row), and bf16 logits tie often:
on SmolLM2-135M's logits 13% of seeded draws at temperature 1 / top_p 0.9 differ from the old
code's (2.8% at 0.7 / 0.95). Keeping the old number of tied tokens, lowest ids first, differed
in 11%: the old choice cannot be had without the old full-row sorts.
"""

from __future__ import annotations

import math

import torch

# Candidate floors, tried in turn (powers of two: see the exactness note). SmolLM2-135M at
# temperature 1: 2^-15 settles 99.5% of rows with ~1.2k candidates a row; 2^-18 most of the
# rest with ~11k, where the full-row sort orders 49152.
FLOORS = (2.0**-15, 2.0**-18)
CANDIDATE_MIN = FLOORS[0]
# The full rule looks past the 256 best tokens only when they hold less than top_p
# (vLLM-style top-p as it was written here first: a topk of 256, then a sort of wide rows).
HEAD_WINDOW = 256
_BITS = 0x7FFFFFFF  # a positive float32's bits, as an int, order like the float


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The full-row rule, in place on probs [n, V] (zeros elsewhere): keep the best tokens
    while the mass before them is below top_p[i] (always the best one: a top_p of 0 in float32
    would otherwise keep nothing), and every token tied with the last one kept. Sorts each
    row: for the rows `nucleus_sample` cannot settle."""
    vals = probs.sort(dim=-1, descending=True).values  # [n, V]
    cum = vals.cumsum(-1)
    p = top_p.unsqueeze(1)  # [n, 1]
    keep = (cum - vals) < p  # a prefix: cum - vals (the mass before) only grows
    keep[:, 0] = True
    if probs.shape[1] > HEAD_WINDOW:
        keep[:, HEAD_WINDOW:] &= cum[:, HEAD_WINDOW - 1:HEAD_WINDOW] < p
    last = vals.gather(1, keep.sum(-1, keepdim=True) - 1)  # [n, 1] the cut's probability
    return probs.masked_fill_(probs < last, 0.0)


def nucleus_sample(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None,
                   uniforms: torch.Tensor,
                   floor: float = CANDIDATE_MIN) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p, then min-p (of the row's best), then an inverse-CDF draw with uniforms [n], for
    probs [n, V] (softmax rows; not written), over the tokens with p >= floor (a power of two).
    -> (tokens [n], settled [n] bool): rows not settled have no token yet (module docstring)."""
    n, vocab = probs.shape
    exponent = math.frexp(floor)[1] - 1
    assert floor == 2.0**exponent and n < 2 ** (29 + exponent), (floor, n)
    flat = probs.reshape(-1)
    index = (flat >= floor).nonzero().squeeze(1)  # [k], rows ascending, ids within
    if index.numel() == 0:
        return (torch.zeros(n, dtype=torch.long, device=probs.device),
                torch.zeros(n, dtype=torch.bool, device=probs.device))
    rows = index // vocab
    vals = flat.index_select(0, index)  # [k]
    counts = torch.bincount(rows, minlength=n)  # [n]
    starts = counts.cumsum(0) - counts
    cut, best, settled = _cut(rows, vals, counts, starts, top_p, floor)
    kept = vals >= cut.index_select(0, rows)  # [k]
    if min_p is not None:  # vals < 0 drops nothing: rows without min_p give 0
        kept &= ~(vals < (best * min_p).index_select(0, rows))
    chosen = _search(rows, torch.where(kept, vals, 0.0), counts, starts, uniforms)
    return index.index_select(0, chosen) - rows.index_select(0, chosen) * vocab, settled


def _cut(rows: torch.Tensor, vals: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor,
         top_p: torch.Tensor,
         floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the probability of the last token kept, the best probability, and whether the
    nucleus ends among the candidates. Candidates sorted by row, best first: one sort of
    int64 keys (row, then the float's bits reversed)."""
    k = vals.numel()
    key = ((rows << 31) | (_BITS - vals.view(torch.int32)).long()).sort().values
    srows = key >> 31
    svals = (_BITS - (key & _BITS)).to(torch.int32).view(torch.float32)  # [k], best first
    mass = _running_sums(svals, starts, srows)  # exact, in double
    cum = mass.float()  # what the full rule's cumsum holds at each position
    # Kept: a prefix (the mass before a token only grows), at least the best token (a top_p of
    # 0 in float32 keeps nothing else), no further than HEAD_WINDOW unless the row is wide.
    before = (cum - svals) < top_p.index_select(0, srows)
    num_kept = torch.zeros_like(counts).index_add_(0, srows, before.long()).clamp_(min=1)
    window = num_kept.clamp(max=HEAD_WINDOW)
    num_kept = torch.where(_wide(cum, counts, starts, top_p), num_kept, window)
    total = mass.index_select(0, _clamped(starts + counts - 1, k))
    settled = (counts > 0) & (total.float().double() - floor >= top_p.double())
    return (svals.index_select(0, _clamped(starts + num_kept - 1, k)),
            svals.index_select(0, _clamped(starts, k)), settled)


def _wide(cum: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor,
          top_p: torch.Tensor) -> torch.Tensor:
    """[n] rows whose HEAD_WINDOW best hold less than top_p. A row with fewer candidates is
    not wide when settled (its candidates alone hold top_p)."""
    at = _clamped(starts + HEAD_WINDOW - 1, cum.numel())
    return (counts >= HEAD_WINDOW) & (cum.index_select(0, at) < top_p)


def _running_sums(vals: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """vals [k] grouped by row (rows [k]) -> each one's running sum within its row, in double:
    one global cumsum less the sum of the rows before (exact: see the module docstring)."""
    total = vals.cumsum(0, dtype=torch.float64)
    first = _clamped(starts, vals.numel())
    before = total.index_select(0, first) - vals.index_select(0, first)  # [n] rows before
    return total.sub_(before.index_select(0, rows))


def _search(rows: torch.Tensor, kept: torch.Tensor, counts: torch.Tensor,
            starts: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw over each row's kept mass kept [k] (candidates in id order, zeros
    for the dropped): -> [n] positions in the candidates. As sample_from_probs: x = u * total,
    kept below the total, and the first candidate whose CDF passes x."""
    k = kept.numel()
    cdf = _running_sums(kept, starts, rows).float()  # the full row's CDF at the candidates
    total = cdf.index_select(0, _clamped(starts + counts - 1, k))  # [n]
    x = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    # Rows apart by 2 and each CDF within [0, 1]: one sorted key for all rows (exact in double)
    keys = cdf.double().add_(rows, alpha=2)
    targets = x.double().add_(torch.arange(total.numel(), device=kept.device), alpha=2)
    return torch.searchsorted(keys, targets, right=True).clamp_(max=k - 1)


def _clamped(index: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of rows without candidates point anywhere valid; their results are unused."""
    return index.clamp(0, k - 1)
