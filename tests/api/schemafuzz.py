"""Hypothesis strategies for request bodies, derived from the server's own /openapi.json.

For each field the document lists, a value is drawn from one of three pools: a plausible
value (so many requests get through validation and exercise the success path), a value of
the documented JSON type with boundary numbers (0, -1, 2**63, 1e308, ...), or any JSON at
all (wrong types, nesting). Bodies may miss required fields, carry unknown ones, contain
NaN/Infinity, or arrive as broken bytes. Torch-free: used against the fake engine and the
real stack alike.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

ROLES = ["system", "developer", "user", "assistant", "tool", "function"]
BOUNDARY_INTS = [0, 1, -1, 2, 20, 21, 127, 128, 129, 256, 257, 2**31, 2**53 + 1,
                 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 10**30]
BOUNDARY_FLOATS = [0.0, -0.0, 1e-300, 0.5, 1.0, 1.5, 2.0, 100.0, -2.0, 1e308, -1e308,
                   float("inf"), float("-inf"), float("nan")]

_text = st.text(max_size=12)
_odd_text = st.sampled_from(["\ud800", "\x00", "\u00e9\u4e2d\U0001f600", " " * 40, "<|im_end|>"])
_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), _text)
ANY_JSON: st.SearchStrategy[Any] = st.recursive(
    _scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(_text, inner, max_size=4)),
    max_leaves=12)


def _token_ids(vocab: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, vocab - 1), min_size=0, max_size=12)


def _message() -> st.SearchStrategy[dict[str, Any]]:
    """Mostly a valid message; now and then an unknown role or a null content."""
    content = st.one_of(_text, _text, _text, st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": _text}), max_size=2))
    # A tool message needs the tool_call_id it answers (a 400 without one).
    valid = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from([r for r in ROLES if r != "tool"]),
                               "content": content}),
        st.fixed_dictionaries({"role": st.just("tool"), "content": content,
                               "tool_call_id": st.just("call_1")}))
    odd = st.fixed_dictionaries({"role": st.sampled_from([*ROLES, "robot", ""]),
                                 "content": st.one_of(content, st.none())})
    return st.one_of(valid, valid, valid, odd)


def plausible(model: str, vocab: int, chat: bool) -> dict[str, st.SearchStrategy[Any]]:
    """Values a real client would send, per field name (fields not here use their type)."""
    small = st.integers(0, 8)
    return {
        "model": st.sampled_from([model, "no-such-model"]),
        "prompt": st.one_of(_text, _odd_text, st.lists(_text, min_size=1, max_size=3),
                            _token_ids(vocab),
                            st.lists(_token_ids(vocab), min_size=1, max_size=3)),
        "messages": st.lists(_message(), min_size=1, max_size=3),
        "tokens": _token_ids(vocab + 10),
        "max_tokens": small, "max_completion_tokens": small, "min_tokens": st.integers(0, 3),
        "n": st.integers(1, 3), "best_of": st.integers(1, 3),
        "temperature": st.floats(0, 2.5), "top_p": st.floats(0, 1.2),
        "top_k": st.integers(-2, 60), "min_p": st.floats(0, 1.1),
        "presence_penalty": st.floats(-2.5, 2.5), "frequency_penalty": st.floats(-2.5, 2.5),
        "repetition_penalty": st.floats(0, 2.5),
        "seed": st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from(BOUNDARY_INTS)),
        "stop": st.one_of(_text, st.lists(_text, max_size=3)),
        "stop_token_ids": _token_ids(vocab + 10),
        "logit_bias": st.dictionaries(st.one_of(st.integers(0, vocab + 10).map(str), _text),
                                      st.floats(-150, 150), max_size=3),
        "logprobs": st.booleans() if chat else st.integers(-1, 22),
        "top_logprobs": st.integers(-1, 22), "echo": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        "tools": st.sampled_from([[], [{"type": "function"}]]),
        "priority": st.integers(-5, 5), "suffix": st.none(), "user": _text,
        "timeout": st.floats(1.0, 60.0),
    }


def typed(spec: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A value of the documented JSON type (anyOf / a list of types: any of them), boundaries
    included; constraints are ignored on purpose (boundary values probe them)."""
    for key in ("oneOf", "anyOf"):
        if key in spec:
            return st.one_of([typed(s) for s in spec[key]])
    if "const" in spec or "enum" in spec:
        return st.sampled_from(spec["enum"] if "enum" in spec else [spec["const"]])
    kind = spec.get("type")
    if isinstance(kind, list):
        return st.one_of([typed({**spec, "type": k}) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "integer":
        return st.one_of(st.integers(-10, 300), st.sampled_from(BOUNDARY_INTS))
    if kind == "number":
        return st.one_of(st.floats(), st.sampled_from(BOUNDARY_FLOATS), st.integers(-3, 3),
                         st.sampled_from(BOUNDARY_INTS))
    if kind == "string":
        return st.one_of(_text, _odd_text)
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(st.one_of(st.integers(-1, 400), _text, ANY_JSON), max_size=4)
    if kind == "object":
        return st.dictionaries(_text, ANY_JSON, max_size=3)
    return ANY_JSON


def field_value(name: str, spec: dict[str, Any],
                hints: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    pools = [typed(spec), ANY_JSON]
    if name in hints:  # twice: most requests should be valid-shaped
        pools = [hints[name], hints[name], *pools]
    return st.one_of(pools)


def request_schema(openapi: dict[str, Any], path: str) -> dict[str, Any]:
    body = openapi["paths"][path]["post"]["requestBody"]
    schema: dict[str, Any] = body["content"]["application/json"]["schema"]
    return schema


@st.composite
def bodies(draw: st.DrawFn, schema: dict[str, Any], hints: dict[str, st.SearchStrategy[Any]],
           one_of: tuple[str, ...] = (), mutated: bool | None = None) -> dict[str, Any]:
    """A JSON object, valid-shaped (required fields plus a few optional ones, plausible
    values only) or mutated (fields missing, any value, unknown fields); `mutated` None:
    either. `one_of`: fields of which a valid body has exactly one (OpenAPI 3.1 has no
    simple way to say so, e.g. /tokenize's prompt or messages)."""
    props: dict[str, dict[str, Any]] = schema["properties"]
    if mutated is None:
        mutated = draw(st.booleans())
    required = set(schema.get("required", []))
    if one_of and not mutated:
        required.add(draw(st.sampled_from(one_of)))
    body: dict[str, Any] = {}
    for name in sorted(props):
        if name in required:
            wanted = not mutated or draw(st.integers(0, 9)) > 0
        elif name in one_of and not mutated:
            wanted = False
        else:
            wanted = draw(st.integers(0, 19)) < (4 if mutated else 1)
        if not wanted:
            continue
        if mutated:
            body[name] = draw(field_value(name, props[name], hints))
        else:
            body[name] = draw(hints[name] if name in hints else typed(props[name]))
    if mutated:
        extra = draw(st.dictionaries(st.text(min_size=1, max_size=8), ANY_JSON, max_size=2))
        for key, value in extra.items():
            body.setdefault(key, value)
    return body


@st.composite
def encoded(draw: st.DrawFn, body: st.SearchStrategy[dict[str, Any]],
            breakage: bool = True) -> bytes:
    """The body as bytes: plain JSON (NaN/Infinity allowed through), or with `breakage`
    sometimes broken (truncated, a byte that is not UTF-8, not an object)."""
    value = draw(body)
    raw = json.dumps(value, allow_nan=True).encode()
    if not breakage:
        return raw
    how = draw(st.sampled_from(["json"] * 12 + ["truncate", "bad_utf8", "array"]))
    if how == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "bad_utf8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + b"\xff\xc0" + raw[at:]
    elif how == "array":
        raw = b"[" + raw + b"]"
    return raw


def error_param_root(param: str) -> str:
    """`messages[0].role` -> `messages`."""
    return param.split("[", 1)[0].split(".", 1)[0]
