"""Synthetic steps of a chosen shape, and the start-up calibration of the step-time budget.

The budget (scheduler/step_budget.py) prices prompt work with a cost model fitted to the
server's own steps. Fitted only from live steps, a fresh server's first fit comes from its
first few prompt steps, and when those are alike (the same number of ~100-token prompts each)
the per-token and per-chunk terms cannot be told apart: the fit may put a prompt's whole cost
on the chunk term and price every chunk above the allowance, so steps take only the one-block
floor until varied steps correct it (issue 34: TTFT 4.2x at 4 streams). Calibration times
ModelRunner.execute on a grid of varied shapes at start-up (decode-only at two contexts,
prompt chunks of several lengths from scratch and after cached tokens, mixes of both, and
sampled rows), so the first fit separates the terms; live steps then keep it current, and
the calibration's points leave the fit's window after WINDOW live steps.

The synthetic sequences write their K/V into the pool's blocks (round-robin) before any
request exists. No request can read them: the block manager starts empty, so no block is
cached for a prefix, and a sequence reads only the slots it has written. Their sampled rows
are seeded, so the sampler's shared generator for unseeded requests is untouched.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Iterator
from typing import Any

from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence
from scheduler.step_cost import StepShape, shape_of

logger = logging.getLogger("pagedserve.engine")

TOKENS = range(1000, 3000)  # ordinary ids of SmolLM2's vocabulary (the benchmarks' default)
GREEDY = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=0, max_tokens=1 << 20,
                         ignore_eos=True)
REPEATS = 2  # timed runs of each shape after an untimed one, the faster kept: a one-off
# stall (a first call's set-up, a neighbour's burst) only ever lengthens a step
# The budget prices chunks that fit beside a decode step (a target of tens of ms), far below
# a whole token budget; the model's per-token and attention terms extrapolate past these.
LONGEST_CHUNK = 512  # tokens
LONGEST_CONTEXT = 1024

# (decode rows, their context, prompt tokens, cached before them, decode rows sampled?)
Point = tuple[int, int, int, int, bool]


def step_of(rows: list[tuple[int, int, int]], blocks: Iterator[int], block_size: int,
            rng: random.Random, params: SamplingParams = GREEDY, tokens: range = TOKENS,
            prefix: str = "calibration-") -> SchedulerOutput:
    """A step of one sequence per (total tokens, computed before, scheduled now) row, with
    random tokens from `tokens` and block tables covering them, drawn in turn from `blocks`;
    the sequences' ids are `prefix` and their row."""
    out = SchedulerOutput()
    for i, (total, computed, n) in enumerate(rows):
        seq = Sequence(f"{prefix}{i}", [rng.choice(tokens) for _ in range(total)], params)
        seq.num_computed_tokens = computed
        seq.block_table = [next(blocks) for _ in range(-(-total // block_size))]
        out.seqs.append(seq)
        out.num_scheduled_tokens.append(n)
    return out


def build_step(point: Point, blocks: Iterator[int], block_size: int, rng: random.Random,
               vocab_size: int) -> SchedulerOutput:
    """One step of `point`'s shape: the decode rows first, then at most one prompt chunk; its
    tokens from the middle of the vocabulary (ordinary ids, none special)."""
    d, ctx, p, cached, sampled = point
    tokens = range(vocab_size // 4, vocab_size // 2)
    decodes = step_of([(ctx, ctx - 1, 1)] * d, blocks, block_size, rng,
                      SAMPLED if sampled else GREEDY, tokens)
    if p:
        chunk = step_of([(cached + p, cached, p)], blocks, block_size, rng, GREEDY, tokens,
                        prefix="calibration-prompt-")
        decodes.seqs += chunk.seqs
        decodes.num_scheduled_tokens += chunk.num_scheduled_tokens
    return decodes


def grid(max_rows: int, max_tokens: int, max_len: int, block_size: int,
         num_blocks: int) -> list[Point]:
    """Varied shapes within the engine's limits: decode batches of 1, a quarter and all of
    max_rows at a short and a long context (the widest batch's rows fitting the pool side by
    side); prompt chunks of a block to LONGEST_CHUNK tokens, from scratch and after cached
    tokens; mixes; and the widest batch sampled. Every kind appears at least MIN_POINTS times
    (scheduler/step_budget.py), so the fit is taken."""
    rows = sorted({1, max(1, max_rows // 4), max_rows} & set(range(1, max_tokens + 1)))
    room = num_blocks // rows[-1] * block_size  # each widest-batch row's own blocks
    long = max(2, min(LONGEST_CONTEXT, max_len - 1, room))
    short = max(1, min(128, long // 8))
    decode = [(d, c, 0, 0, False) for d in rows for c in sorted({short, long})]
    chunks = sorted({min(p, max_tokens, max_len, LONGEST_CHUNK)
                     for p in (block_size, 4 * block_size, 16 * block_size, 32 * block_size,
                               max_tokens // 4, max_tokens // 2) if p > 0})
    cached = min(512, max_len - chunks[0]) // block_size * block_size
    # After cached tokens only the shorter chunks: the longest cost the most to time, and
    # their attention is already pinned by the chunks' lengths from scratch.
    prefill = [(0, 0, p, 0, False) for p in chunks] + [
        (0, 0, p, cached, False) for p in chunks[:-1] if cached and p + cached <= max_len]
    mixed = [(d, short, p, 0, False) for d in rows[-2:] for p in chunks[:2]
             if d + p <= max_tokens]
    sampled = [(rows[-1], short, 0, 0, True), (rows[-1], long, 0, 0, True)]
    return decode + prefill + mixed + sampled


def calibrate(runner: Any, max_rows: int, max_tokens: int, max_len: int,
              num_blocks: int, repeats: int = REPEATS,
              seed: int = 0) -> list[tuple[StepShape, float]]:
    """(shape, fastest seconds of runner.execute) for each grid point: every point run once
    untimed, then in a shuffled order `repeats` times over (drift spreads over all)."""
    rng = random.Random(seed)
    blocks = itertools.cycle(range(num_blocks))
    points = grid(max_rows, max_tokens, max_len, runner.block_size, num_blocks)
    steps = {pt: build_step(pt, blocks, runner.block_size, rng, runner.vocab_size)
             for pt in points}
    order = [pt for _ in range(repeats) for pt in points]
    rng.shuffle(order)
    logger.info("step-time budget: running %d synthetic steps of %d shapes to fit its cost "
                "model", len(order) + len(points), len(points))
    started = time.perf_counter()
    for pt in points:  # untimed: first calls set up kernels, buffers and graphs
        runner.execute(steps[pt])
    times: dict[Point, list[float]] = {pt: [] for pt in points}
    for pt in order:
        t0 = time.perf_counter()
        runner.execute(steps[pt])
        times[pt].append(time.perf_counter() - t0)
    logger.info("step-time budget: ran them in %.1f s", time.perf_counter() - started)
    return [(shape_of(steps[pt]), min(times[pt])) for pt in points]
