"""The discrete-event loop: N simulated replicas behind a router, driven by a conversation trace.

Two kinds of event on one simulated clock: a request arrives (the router picks a replica; an
idle replica starts a step at once), and a replica's step ends (its sequences advance, a
finished turn schedules the conversation's next turn a think time later, and the replica
starts its next step at once). Events at the same instant run in the order they were pushed,
so a run is a pure function of its config.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from benchmarks.sim_replica import SimReplica
from benchmarks.sim_router import make_router
from benchmarks.sim_workload import Conversation, WorkloadConfig, make_trace, percentile
from benchmarks.step_cost import CostModel
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence

ARRIVE, STEP_DONE = 0, 1


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_replicas: int
    policy: str
    workload: WorkloadConfig
    scheduler: SchedulerConfig
    num_kv_blocks: int  # per replica
    cost: CostModel
    imbalance_threshold: int = 8  # prefix-aware: "overloaded" margin, in in-flight requests
    seed: int = 0  # the router's random choices (the trace has its own seed)


@dataclass(slots=True)
class RequestRecord:
    conv: Conversation
    turn: int
    arrival_s: float
    replica: int = -1
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def output_len(self) -> int:
        return len(self.conv.turns[self.turn].output)


@dataclass(slots=True)
class Simulation:
    config: SimConfig
    replicas: list[SimReplica] = field(default_factory=list)
    records: dict[str, RequestRecord] = field(default_factory=dict)
    _events: list[tuple[float, int, int, Any]] = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)  # type: ignore[type-arg]
    now: float = 0.0
    # Steady-state window: from 10% of the conversations' start span to the last start, while
    # load is offered at the configured rate (no warm-up, no drain tail). Tokens sampled in it.
    window: tuple[float, float] = (0.0, 0.0)
    window_tokens: int = 0

    def run(self) -> dict[str, Any]:
        cfg = self.config
        self.replicas = [SimReplica(i, cfg.scheduler, cfg.num_kv_blocks, cfg.cost, self._token)
                         for i in range(cfg.num_replicas)]
        router = make_router(cfg.policy, cfg.seed, cfg.scheduler.block_size,
                             cfg.num_kv_blocks, cfg.imbalance_threshold)
        trace = make_trace(cfg.workload)
        self.window = (0.1 * trace[-1].start_s, trace[-1].start_s)
        for conv in trace:
            self._push(conv.start_s, ARRIVE, (conv, 0))
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == ARRIVE:
                conv, turn = payload
                self._arrive(conv, turn, router.choose(conv.turns[turn].prompt, self.replicas))
            else:
                self._step_done(self.replicas[payload])
        return summarize(self, router)

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, payload))

    def _token(self, seq: Sequence) -> int:
        rec = self.records[seq.seq_id]
        return rec.conv.turns[rec.turn].output[seq.num_output_tokens]

    def _arrive(self, conv: Conversation, turn: int, replica: int) -> None:
        t = conv.turns[turn]
        seq_id = f"c{conv.conv_id}t{turn}"
        self.records[seq_id] = RequestRecord(conv, turn, self.now, replica)
        params = SamplingParams(temperature=0, max_tokens=len(t.output), ignore_eos=True)
        rep = self.replicas[replica]
        rep.add(Sequence(seq_id, list(t.prompt), params, arrival_time=self.now))
        if not rep.busy:
            self._start(rep)

    def _start(self, rep: SimReplica) -> None:
        dt = rep.start_step()
        if dt is not None:
            self._push(self.now + dt, STEP_DONE, rep.index)

    def _step_done(self, rep: SimReplica) -> None:
        events = rep.finish_step()
        if self.window[0] <= self.now <= self.window[1]:
            self.window_tokens += len(events)  # every event is one sampled output token
        for ev in events:
            rec = self.records[ev.seq.seq_id]
            if ev.first_token:
                rec.first_token_s = self.now
            if ev.finished:
                assert rec.finish_s is None, f"{ev.seq.seq_id} finished twice"
                rec.finish_s = self.now
                self._next_turn(rec)
        self._start(rep)

    def _next_turn(self, rec: RequestRecord) -> None:
        if rec.turn + 1 < len(rec.conv.turns):
            rng_think = _think_time(rec, self.config.workload)
            self._push(self.now + rng_think, ARRIVE, (rec.conv, rec.turn + 1))


def _think_time(rec: RequestRecord, wl: WorkloadConfig) -> float:
    """Exponential with the workload's mean, fixed per (conversation, turn): independent of
    event order, so the trace a policy sees differs only by when answers end."""
    rng = random.Random(hash((wl.seed, rec.conv.conv_id, rec.turn)))
    return rng.expovariate(1.0 / wl.think_time_s) if wl.think_time_s > 0 else 0.0


def summarize(sim: Simulation, router: Any) -> dict[str, Any]:
    recs = list(sim.records.values())
    done = [r for r in recs if r.finish_s is not None]
    ttft = [r.first_token_s - r.arrival_s for r in recs if r.first_token_s is not None]
    e2e = [r.finish_s - r.arrival_s for r in done if r.finish_s is not None]
    start = min((r.arrival_s for r in recs), default=0.0)
    span = max((r.finish_s for r in done if r.finish_s is not None), default=start) - start
    queries = sum(rep.prefix_cache[0] for rep in sim.replicas)
    hits = sum(rep.prefix_cache[1] for rep in sim.replicas)
    out_tokens = sum(r.output_len for r in done)
    per_replica = [rep.num_requests for rep in sim.replicas]
    return {
        "num_replicas": sim.config.num_replicas, "policy": sim.config.policy,
        "rate": sim.config.workload.rate, "requests": len(recs), "finished": len(done),
        "duration_s": span,
        "request_throughput": len(done) / span if span > 0 else 0.0,
        "output_throughput": _window_rate(sim),
        "output_throughput_makespan": out_tokens / span if span > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "preemptions": sum(rep.scheduler.num_preemptions for rep in sim.replicas),
        "steps": sum(rep.num_steps for rep in sim.replicas),
        "utilization": [round(rep.busy_s / span, 4) if span > 0 else 0.0
                        for rep in sim.replicas],
        "requests_per_replica": per_replica,
        "affinity_routed": getattr(router, "num_affinity", None),
        "overloaded_fallbacks": getattr(router, "num_overloaded", None),
    }


def _window_rate(sim: Simulation) -> float:
    """Output tokens/s in the steady-state window (at overload: what the replicas sustain)."""
    a, b = sim.window
    return sim.window_tokens / (b - a) if b > a else float("nan")


def simulate(config: SimConfig) -> dict[str, Any]:
    return Simulation(config).run()
