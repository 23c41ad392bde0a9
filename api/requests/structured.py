"""Structured-output request fields -> one StructuredOutputsParams (or None), for both routes.

Three spellings of the same idea are accepted, at most one constraint per request:
- OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"} or
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
- vLLM's `structured_outputs` object: json, regex, choice, grammar or json_object;
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  (and `guided_json_object`).
Only types are checked here; whether a schema, regex or grammar compiles is the engine's
answer (a 400 naming the same field, before any byte is streamed). A sub-field that would
change the output and that we do not implement is refused by name, never ignored.
"""

from __future__ import annotations

import json
from typing import Any

from api.errors import bad_request
from api.requests.params import check_unicode_in
from engine.protocol import StructuredOutputsParams

# structured_outputs flags that cannot change what we produce: we have no fallback backend,
# never emit free whitespace, and (strict mode) never add properties a schema did not list.
_HARMLESS_FLAGS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
_BACKENDS = ("auto", "xgrammar")  # guided_decoding_backend values we honour (the one we use)


def parse_structured(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's one constraint, or None; a 400 naming the field when malformed, when a
    sub-field is not supported, or when more than one constraint is given."""
    _check_guided_options(body)
    found = [so for so in (_response_format(body.get("response_format")),
                           _structured_outputs(body.get("structured_outputs")),
                           *_guided(body)) if so is not None]
    if len(found) > 1:
        names = ", ".join(so.param for so in found)
        raise bad_request(f"only one structured output constraint may be given, got {names}",
                          param=found[1].param)
    return found[0] if found else None


def _response_format(value: Any) -> StructuredOutputsParams | None:
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("response_format must be an object", param=param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams("json_object", "", param)
    if kind != "json_schema":
        raise bad_request("response_format.type must be text, json_object or json_schema",
                          param=param)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object", param=param)
    if not isinstance(spec.get("name"), str):
        raise bad_request("response_format.json_schema.name must be a string", param=param)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict must be a boolean", param=param)
    # strict or not, the output follows the schema (a grammar cannot half-follow it).
    schema = spec.get("schema")
    if schema is None:  # OpenAI makes it optional: then any JSON object
        return StructuredOutputsParams("json_object", "", param)
    if not isinstance(schema, (dict, bool)):
        raise bad_request("response_format.json_schema.schema must be an object", param=param)
    check_unicode_in(schema, "response_format.json_schema.schema")
    check_local_refs(schema, "response_format.json_schema.schema")
    return StructuredOutputsParams("json", json.dumps(schema), param)


def _structured_outputs(value: Any) -> StructuredOutputsParams | None:
    param = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", param=param)
    found: list[StructuredOutputsParams] = []
    for key, sub in value.items():
        where = f"{param}.{key}"
        if sub is None:
            continue
        if key in _HARMLESS_FLAGS:
            if not isinstance(sub, bool):
                raise bad_request(f"{where} must be a boolean", param=where)
            continue
        so = _constraint(key, sub, where)
        if so is not None:
            found.append(so)
    if len(found) > 1:
        raise bad_request("structured_outputs takes exactly one of json, regex, choice, grammar "
                          "or json_object", param=found[1].param)
    return found[0] if found else None


def _constraint(key: str, value: Any, where: str) -> StructuredOutputsParams | None:
    """One of json / regex / choice / grammar / json_object, named `where` in errors."""
    check_unicode_in(value, where)  # a lone surrogate compiles into a grammar of U+FFFD
    if key == "json":
        if isinstance(value, str):
            check_local_refs(_schema_text(value), where)
            return StructuredOutputsParams("json", value, where)
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{where} must be a JSON schema (an object or its JSON text)",
                              param=where)
        check_local_refs(value, where)
        return StructuredOutputsParams("json", json.dumps(value), where)
    if key in ("regex", "grammar"):
        if not isinstance(value, str):
            raise bad_request(f"{where} must be a string", param=where)
        return StructuredOutputsParams(key, value, where)  # type: ignore[arg-type]
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise bad_request(f"{where} must be a list of strings", param=where)
        return StructuredOutputsParams("choice", json.dumps(value), where)
    if key == "json_object":
        if not isinstance(value, bool):
            raise bad_request(f"{where} must be a boolean", param=where)
        return StructuredOutputsParams("json_object", "", where) if value else None
    raise bad_request(f"{where} is not supported", param=where)


def _guided(body: dict[str, Any]) -> list[StructuredOutputsParams | None]:
    return [_constraint(name.removeprefix("guided_"), body[name], name)
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                         "guided_json_object")
            if body.get(name) is not None]


def _check_guided_options(body: dict[str, Any]) -> None:
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in _BACKENDS:
        raise bad_request(f"guided_decoding_backend {backend!r} is not supported (this server "
                          f"uses xgrammar)", param="guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        raise bad_request("guided_whitespace_pattern is not supported",
                          param="guided_whitespace_pattern")


def check_local_refs(schema: Any, where: str) -> None:
    """A 400 naming `where` for a `$ref` that points outside the schema ("https://...",
    "other.json#/x"): nothing is fetched, and the compiler treated such a reference as "any
    value", silently dropping the constraint. Local ones ("#", "#/$defs/x") are kept."""
    if isinstance(schema, list):
        for item in schema:
            check_local_refs(item, where)
    elif isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise bad_request(f"{where}: $ref {ref!r} points outside the schema; only local "
                              "references (\"#/$defs/...\") are supported, nothing is fetched",
                              param=where)
        for item in schema.values():
            check_local_refs(item, where)


def _schema_text(text: str) -> Any:
    """A schema given as JSON text, parsed for the checks (None if it is not JSON: the
    compiler's own 400 says so)."""
    try:
        return json.loads(text)
    except ValueError:
        return None
