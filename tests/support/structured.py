"""Structured-output test helpers: an engine on a shared runner, a driver that collects each
request's text and finish reason, and the JSON schemas the tests sample against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[Any] = field(default_factory=list)


def make_engine(runner: ModelRunner, num_kv_blocks: int | None = None,
                **sched: Any) -> LLMEngine:
    opts: dict[str, Any] = {"block_size": runner.block_size, "max_num_seqs": 32,
                            "max_num_batched_tokens": 256, "max_model_len": 256}
    opts.update(sched)
    cfg = EngineConfig(model=None, dtype="float32", device="cpu", enforce_eager=True, num_kv_blocks=num_kv_blocks,
                       scheduler=SchedulerConfig(**opts))
    engine = LLMEngine(cfg, runner=runner)
    engine.load()
    return engine


def run_all(engine: LLMEngine) -> dict[str, Result]:
    """Step until every request has finished (waiting on compiles, never spinning)."""
    results: dict[str, Result] = {}
    while engine.has_unfinished():
        if not engine.has_runnable():
            engine.wait_for_grammars()
        for out in engine.step():
            r = results.setdefault(out.request_id, Result())
            r.text += out.new_text
            r.token_ids += out.new_token_ids
            r.logprobs += out.logprobs or ()
            if out.finished:
                r.finish_reason, r.error = out.finish_reason, out.error
    engine.scheduler.check_invariants()
    return results


def single_token_ids(hf_tokenizer: Any, chars: str) -> list[int]:
    """Ids of the one-token spellings of `chars` (for logit_bias that ends values sooner)."""
    ids = []
    for c in chars:
        enc = hf_tokenizer.encode(c, add_special_tokens=False)
        if len(enc) == 1:
            ids.append(enc[0])
    return ids


_POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
          "required": ["x", "y"], "additionalProperties": False}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["id", "tags"]}}, "required": ["user"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 10,
                                                "maximum": 99}}, "required": ["score"]},
    {"type": "object", "properties": {"t": {"type": "number", "minimum": -1.5,
                                            "maximum": 2.5}}, "required": ["t"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]{2,5}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 6}},
     "required": ["s"]},
    {"$defs": {"point": _POINT}, "type": "object",
     "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
     "required": ["a", "b"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "string", "maxLength": 4},
                                                      {"type": "integer"}]}},
     "required": ["v"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["ok", "none"]},
    {"type": "array", "items": _POINT, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"kind": {"const": "fixed"}, "n": {"type": "integer"}},
     "required": ["kind", "n"]},
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
     "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},
    {"type": "object", "properties": {"mixed": {"enum": [1, "two", None, True]}},
     "required": ["mixed"]},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"r": {"type": "integer", "minimum": 0}},
         "required": ["r"], "additionalProperties": False},
        {"type": "object", "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}},
         "required": ["w", "h"], "additionalProperties": False}]}}, "required": ["shape"]},
    {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"]}}, "$ref": "#/$defs/node"},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 4},
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 5}},
     "required": ["maybe"]},
    {"type": "object", "properties": {"p": {"type": "integer"}, "q": {"type": "boolean"},
                                      "r": {"enum": ["x", "y"]}},
     "required": ["p", "q", "r"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 2,
                                                "maxItems": 4, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z][0-9]$"},
                                         "qty": {"type": "integer", "minimum": 1,
                                                 "maximum": 5}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0,
                                                "maximum": 1}, "label": {"type": "string",
                                                                         "minLength": 1}},
     "required": ["ratio", "label"]},
]
