"""Every server up at once, the loads taken in turn: at each concurrency every server runs
before the next concurrency starts, the first one a different server each time.

Run one after another (start, drive c=1..64, stop, next server), two servers' numbers at the
same load are minutes apart, and on a shared 2-core box the machine's own speed drifts by
~10% over such a span (two fast_step runs on 2026-12-05 saw one server's c=1 ITL move 10%
between runs). Interleaved, the servers compared at one load are measured within a couple of
minutes of each other, so drift moves them together and their ratio keeps less of it.

Before each load the machine must settle: another server can stay busy for a while after its
own load ends (vLLM's CPU build was seen using ~1.2-1.6 CPU s after each of its loads, which
the next server's load then paid: `foreign_cores` 0.07-0.2 for the server after it, ~0.03 for
the others, on 2026-12-05 17:07), so the next load starts only once the whole machine has been
idle for a short window (`settle`; the wait and what was seen go into the run's record).

The records have Comparison.bench_server's shape (command, description, runs, ready_s,
models, started_at, stopped_at, wall_s, exit_code; error and log_tail on a failure), so the
reports and checks read them unchanged. Servers start one at a time, each waiting for the one
before to be healthy and warmed up, so a start-up time is never shared with another start.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import ServerProcess, wait_for_idle
from benchmarks.compare import WARMUP, Comparison, concurrency_loads
from benchmarks.loadgen import Load, get_models, warm_up
from benchmarks.serving_load import RequestSpec

ERRORS = (RuntimeError, TimeoutError, OSError)


def turn_order(names: list[str], index: int) -> list[str]:
    """Load `index`'s order: the list rotated by `index`, so each server leads one load."""
    if not names:
        return []
    k = index % len(names)
    return names[k:] + names[:k]


def settle() -> dict[str, Any]:
    """Until the machine's busy cores over 1 s are below 0.15 (the load average lags a minute
    behind, so it is not asked), 30 s at most."""
    return wait_for_idle(0.15, 30.0, window_s=1.0, load_avg=False)


def start(comp: Comparison, stack: contextlib.ExitStack, name: str, dtype: str,
          specs: dict[str, list[RequestSpec]]) -> tuple[dict[str, Any], ServerProcess | None]:
    """Start `name`, wait for /health, warm it up. -> (its record, the running server, or
    None when it failed: the record then has the error and the server is stopped)."""
    spec = comp.servers[name]
    extra = comp.args.server_args.get(name, [])
    proc = ServerProcess(name, lambda port: spec.command(comp.folder, dtype, port, extra))
    rec: dict[str, Any] = {"command": proc.command, "description": getattr(spec, "description", ""),
                           "runs": {}, "started_at": time.time(), "_t0": time.perf_counter()}
    print(f"\n[{name} {dtype}] starting: {' '.join(proc.command)}", flush=True)
    stack.enter_context(proc)
    try:
        proc.wait_healthy(comp.args.startup_timeout)
        rec["ready_s"] = time.perf_counter() - rec["_t0"]
        rec["models"] = get_models(proc.base_url)
        asyncio.run(warm_up(proc.base_url, specs[WARMUP], comp.plan.num_warmups,
                            spec.extra_body(True)))
    except ERRORS as e:
        fail(name, rec, proc, e)
        return rec, None
    print(f"[{name}] ready after {rec['ready_s']:.1f} s, warmed up", flush=True)
    return rec, proc


def fail(name: str, rec: dict[str, Any], proc: ServerProcess, e: BaseException) -> None:
    rec["error"] = f"{e.__class__.__name__}: {e}"
    rec["log_tail"] = proc.log_tail()
    print(f"[{name}] FAILED: {rec['error']}", flush=True)
    finish(rec, proc)


def finish(rec: dict[str, Any], proc: ServerProcess) -> None:
    rec["exit_code"] = proc.stop()
    rec["stopped_at"] = time.time()
    rec["wall_s"] = time.perf_counter() - rec.pop("_t0")


@dataclass(frozen=True)
class Turn:
    """One load every live server runs in its turn: its prompts (a key of the specs), how they
    arrive, and request fields on top of each server's own (e.g. temperature and top_p)."""

    specs: str
    load: Load
    body: Mapping[str, Any] = field(default_factory=dict)


def bench_interleaved(comp: Comparison, names: list[str], dtype: str,
                      specs: dict[str, list[RequestSpec]],
                      on_progress: Callable[[dict[str, dict[str, Any]]], None] = lambda r: None,
                      before_start: Callable[[str], None] = lambda n: None,
                      turns: Sequence[Turn] | None = None,
                      after_start: Callable[[str, ServerProcess], dict[str, Any]] | None = None,
                      ) -> dict[str, dict[str, Any]]:
    """Start every server in `names` (in order; `before_start(name)` runs first, e.g. a cold
    start of its own), then each turn (default: the plan's concurrency loads) on every live
    server in turn_order. A server that fails to start, or fails a load, is stopped and left
    out of later loads. `on_progress(records)` after every start and every load (a killed run
    keeps its numbers). A run is recorded under its load's name. `after_start(name, server)`
    runs once a server is up and warmed, before any load (e.g. to read its /metrics); what it
    returns goes into the record under "after_start"."""
    if turns is None:
        turns = [Turn(load.name, load) for load in concurrency_loads(comp.plan)]
    records: dict[str, dict[str, Any]] = {}
    live: dict[str, ServerProcess] = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            before_start(name)
            records[name], proc = start(comp, stack, name, dtype, specs)
            if proc is not None:
                live[name] = proc
                if after_start is not None:
                    records[name]["after_start"] = after_start(name, proc)
            on_progress(records)
        for i, turn in enumerate(turns):
            for name in turn_order([n for n in names if n in live], i):
                proc = live[name]
                body = comp.servers[name].extra_body(True) | dict(turn.body)
                calm = settle()
                began = time.time()
                try:
                    m = asyncio.run(comp.run_load(name, proc, specs[turn.specs], turn.load, body))
                    records[name]["runs"][turn.load.name] = m | {"started_at": began,
                                                                 "settle": calm}
                except ERRORS as e:
                    fail(name, records[name], live.pop(name), e)
            on_progress(records)
        for name, proc in live.items():
            finish(records[name], proc)
    return records
