"""Structured outputs: what a grammar costs per engine step, and what compiling one costs.

Step time: one engine on the real model alternates between two batches of 32 decoding
streams, in rounds (so drift on a shared machine hits both alike):
  free         32 unconstrained streams
  mixed        16 JSON-schema-constrained streams + 16 unconstrained ones
Each phase starts fresh streams (same prompt), so both time the same context lengths; only
steps whose batch is exactly 32 decode tokens are timed (a stream that finishes early is
replaced, and the replacement's prefill step is not counted). Reported: the
median step time of each and their ratio (target: mixed <= 1.10 x free), plus the median
time spent filling the bitmask per step.

Compile: typical schemas compiled once (cache miss, in the compile pool) and again (cache
hit). With --compare-backends, xgrammar and llguidance (if installed) are also measured
directly: compile time and per-token bitmask fill time along a valid output.

    .venv/bin/python benchmarks/bench_structured.py --steps 20 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_info, median, model_folder, save_result
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                        "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}}, "required": ["name", "age"]}
ORDER = {"type": "object", "properties": {"order": {"type": "object", "properties": {
    "id": {"type": "integer"}, "status": {"enum": ["new", "paid", "shipped"]},
    "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                         "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"]}}}, "required": ["id", "items", "status"]}},
    "required": ["order"]}
REFS = {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"},
                                                         "y": {"type": "number"}},
                         "required": ["x", "y"]}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"},
                                         "b": {"anyOf": [{"$ref": "#/$defs/pt"},
                                                         {"type": "null"}]}},
        "required": ["a", "b"]}
SCHEMAS = {"person": PERSON, "order": ORDER, "refs": REFS}
VALID = {"person": '{"name": "Ann Lee", "age": 42, "email": "ann@lee.com"}',
         "order": '{"order": {"id": 7, "status": "paid", "items": [{"sku": "ab12", "qty": 3}]}}',
         "refs": '{"a": {"x": 1.5, "y": -2}, "b": null}'}
# Long-lived constrained streams: an array of at least 40 people does not end within a phase.
STREAM_SCHEMA = {"type": "array", "items": PERSON, "minItems": 40}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--streams", type=int, default=32, help="decoding streams per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per phase and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--compare-backends", action="store_true")
    p.add_argument("--only-backends", action="store_true",
                   help="only the backend comparison (implies --compare-backends)")
    return p.parse_args()


def make_engine(args: argparse.Namespace) -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=args.streams, max_num_batched_tokens=2048,
                            max_model_len=1024)
    engine = LLMEngine(EngineConfig(model=None, dtype=args.dtype, device=args.device,
                                    scheduler=sched))
    engine.load()
    return engine


class Driver:
    """Keeps `streams` requests decoding, `constrained` of them under a grammar."""

    def __init__(self, engine: LLMEngine, streams: int) -> None:
        self.engine, self.streams = engine, streams
        self.prompt = engine.tokenizer.encode("List some people as JSON:")
        self.so = StructuredOutputsParams("json", json.dumps(STREAM_SCHEMA), "bench")
        self.kinds: dict[str, bool] = {}  # request id -> constrained
        self.next_id = 0
        self.fill_s: list[float] = []
        fill = engine.grammars.masks

        def timed_fill(batch: Any) -> Any:  # the bitmask's share of the step
            t0 = time.perf_counter()
            masks = fill(batch)
            if masks is not None:
                self.fill_s.append(time.perf_counter() - t0)
            return masks
        engine.grammars.masks = timed_fill  # type: ignore[method-assign]

    def top_up(self, constrained: int) -> None:
        """Abort the surplus of each kind, add what is missing."""
        want = {True: constrained, False: self.streams - constrained}
        for kind, n in want.items():
            ids = [rid for rid, k in self.kinds.items() if k == kind]
            for rid in ids[n:]:
                self._abort(rid)
            for _ in range(n - len(ids)):
                self._add(kind)

    def _add(self, constrained: bool) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        params = SamplingParams(max_tokens=900, temperature=1.0, seed=self.next_id,
                                ignore_eos=not constrained,
                                structured_outputs=self.so if constrained else None)
        self.engine.add_request(rid, self.prompt, params)
        self.kinds[rid] = constrained

    def _abort(self, rid: str) -> None:
        self.engine.abort_request(rid)
        del self.kinds[rid]

    def step(self) -> tuple[float, bool]:
        """One step: (seconds, whether it was a pure decode step of every stream)."""
        e = self.engine
        if not e.has_runnable():
            e.wait_for_grammars()
        decoding = sum(s.num_computed_tokens == s.num_tokens - 1 for s in e.scheduler.running)
        pure = (decoding == self.streams and e.scheduler.num_waiting == 0)
        t0 = time.perf_counter()
        outs = e.step()
        dt = time.perf_counter() - t0
        for o in outs:
            if o.finished:
                self.kinds.pop(o.request_id, None)
        return dt, pure

    def phase(self, constrained: int, steps: int) -> list[float]:
        for rid in list(self.kinds):
            self._abort(rid)
        times: list[float] = []
        while len(times) < steps:
            self.top_up(constrained)
            dt, pure = self.step()
            if pure:
                times.append(dt)
        return times


def bench_steps(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    d = Driver(engine, args.streams)
    d.phase(0, 3)  # warm up
    free: list[float] = []
    mixed: list[float] = []
    for _ in range(args.rounds):
        free += d.phase(0, args.steps)
        mixed += d.phase(args.streams // 2, args.steps)
    ratio = median(mixed) / median(free)
    return {"streams": args.streams, "constrained_in_mixed": args.streams // 2,
            "free_step_ms_median": 1e3 * median(free), "mixed_step_ms_median": 1e3 * median(mixed),
            "ratio_mixed_over_free": ratio, "within_10_percent": ratio <= 1.10,
            "bitmask_fill_ms_median": 1e3 * median(d.fill_s), "timed_steps_each": len(free)}


def bench_compile(engine: LLMEngine) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, schema in SCHEMAS.items():
        so = StructuredOutputsParams("json", json.dumps(schema), "bench")
        t0 = time.perf_counter()
        engine.structured.compile(so).result()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.structured.compile(so).result()
        out[name] = {"first_ms": 1e3 * first, "cached_ms": 1e3 * (time.perf_counter() - t0)}
    return out


def compare_backends() -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_folder())
    result = {"vocab_size": len(tok), "xgrammar": _xgrammar(tok, len(tok))}
    try:
        result["llguidance"] = _llguidance(tok, len(tok))
    except ImportError:
        result["llguidance"] = "not installed (pip install llguidance)"
    return result


def _xgrammar(tok: Any, vocab: int) -> dict[str, Any]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    res: dict[str, Any] = {"tokenizer_setup_s": time.perf_counter() - t0}
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        compile_s = time.perf_counter() - t0
        m, bitmask = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab)
        fills = []
        for t in tok.encode(VALID[name], add_special_tokens=False):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            fills.append(time.perf_counter() - t0)
            assert m.accept_token(t), (name, t)
        res[name] = _stats(compile_s, fills)
    return res


def _llguidance(tok: Any, vocab: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    res: dict[str, Any] = {"tokenizer_setup_s": time.perf_counter() - t0}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        # Flexible whitespace (its default): its compact mode separates with ":" and ",",
        # which the spaced VALID texts do not follow.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = llguidance.LLMatcher(lltok, grammar)
        assert not m.get_error(), m.get_error()
        compile_s = time.perf_counter() - t0
        bitmask, fills = lt.allocate_token_bitmask(1, vocab), []
        for t in tok.encode(VALID[name], add_special_tokens=False):
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, bitmask, 0)
            fills.append(time.perf_counter() - t0)
            assert m.consume_token(t), (name, t, m.get_error())
        res[name] = _stats(compile_s, fills)
    return res


def _stats(compile_s: float, fills: list[float]) -> dict[str, float]:
    return {"compile_ms": 1e3 * compile_s, "fill_us_median": 1e6 * statistics.median(fills),
            "fill_us_max": 1e6 * max(fills), "tokens": len(fills)}


def main() -> None:
    args = parse_args()
    result: dict[str, Any] = {"benchmark": "structured", "machine": machine_info(),
                              "args": vars(args)}
    if args.compare_backends or args.only_backends:
        result["backends"] = compare_backends()
        print(json.dumps(result["backends"], indent=1))
        if args.only_backends:
            print("saved", save_result("structured-backends", result))
            return
    engine = make_engine(args)
    result["compile"] = bench_compile(engine)
    print(json.dumps(result["compile"], indent=1))
    result["steps"] = bench_steps(engine, args)
    print(json.dumps(result["steps"], indent=1))
    print("saved", save_result("structured", result))


if __name__ == "__main__":
    main()
