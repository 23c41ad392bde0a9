"""Every request field of /v1/completions and /v1/chat/completions, as data: its JSON schema
(with value constraints, served in /openapi.json) and what we do with it.

The rule (a drop-in for vLLM's server): every field vLLM's OpenAI server accepts either works
as in vLLM or, when a request asks for it, is refused with a 400 naming it. A refused field is
only refused when its value asks for something: vLLM's default (`inert`) passes, so clients
that send defaults explicitly keep working. Fields neither OpenAI nor vLLM knows are ignored
with one warning line listing them (as vLLM does). The list follows vLLM's protocol.py
(CompletionRequest, ChatCompletionRequest, StreamOptions), newer names included.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from api.errors import bad_request
from api.requests.options import MAX_REQUEST_ID
from api.requests.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_STOP, MAX_STOP_TOKEN_IDS
from engine.protocol import FLOAT32_MAX, REPETITION_PENALTY_RANGE

logger = logging.getLogger("pagedserve.api")

CMPL, CHAT = "completions", "chat"
BOTH = frozenset({CMPL, CHAT})
MAX_PROMPTS = 256  # prompts (and prompts x n) in one completions request
INT64 = {"minimum": -(2**63), "maximum": 2**63 - 1}


class Status(enum.Enum):
    SUPPORTED = "supported"  # works as in vLLM
    OWNED = "owned"  # structured outputs / tools / chat template: parsed by their own modules
    NO_EFFECT = "no-effect"  # accepted; has no effect here, as in vLLM (see the note)
    REFUSED = "refused"  # 400 naming it unless its value is inert


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    schema: dict[str, Any]
    status: Status = Status.SUPPORTED
    routes: frozenset[str] = BOTH
    inert: tuple[Any, ...] = ()  # REFUSED: values that ask for nothing (null always does)
    example: Any = None  # REFUSED: a value that asks for it (the tests send it)
    note: str = ""


def _t(kind: str | list[str], **constraints: Any) -> dict[str, Any]:
    """A nullable JSON schema of `kind` (null means "the default" everywhere)."""
    kinds = [kind] if isinstance(kind, str) else list(kind)
    return {"type": [*kinds, "null"], **constraints}


def _any_of(*schemas: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [*schemas, {"type": "null"}]}


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_LOGPROB_N = _t("integer", minimum=0, maximum=MAX_LOGPROBS)
_NONE = {"type": "null"}


def _refused(name: str, schema: dict[str, Any], example: Any, note: str, *inert: Any,
             routes: frozenset[str] = BOTH) -> Field:
    return Field(name, schema, Status.REFUSED, routes, inert, example, note)


def _owned(name: str, schema: dict[str, Any], routes: frozenset[str] = BOTH) -> Field:
    return Field(name, schema, Status.OWNED, routes)


_PARTS = {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}
_NAMES = {"name": {"type": ["string", "null"]}, "tool_call_id": {"type": ["string", "null"]}}
# Every role needs content but the assistant's, which may be null (a tool-call turn).
_MESSAGE = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user", "tool", "function"]},
        "content": {"anyOf": [{"type": "string"}, _PARTS]}, **_NAMES}},
    {"type": "object", "required": ["role"], "properties": {
        "role": {"const": "assistant"},
        "content": {"anyOf": [{"type": "string"}, _PARTS, {"type": "null"}]}, **_NAMES}}]}

FIELDS: tuple[Field, ...] = (
    # ---- the prompt ----
    Field("prompt", {"anyOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": {"type": "string"}},
        {**_TOKEN_IDS, "minItems": 1},
        {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
         "items": {**_TOKEN_IDS, "minItems": 1}}]}, routes=frozenset({CMPL})),
    Field("messages", {"type": "array", "minItems": 1, "items": _MESSAGE},
          routes=frozenset({CHAT})),
    Field("model", _t("string")),
    # ---- OpenAI sampling and output ----
    Field("max_tokens", _t("integer", minimum=0)),
    Field("max_completion_tokens", _t("integer", minimum=1), routes=frozenset({CHAT})),
    Field("temperature", _t("number", minimum=0, maximum=FLOAT32_MAX)),
    Field("top_p", _t("number", exclusiveMinimum=0, maximum=1)),
    Field("n", _t("integer", minimum=1, maximum=MAX_N)),
    Field("stop", _any_of({"type": "string", "minLength": 1},
                          {"type": "array", "maxItems": MAX_STOP,
                           "items": {"type": "string", "minLength": 1}})),
    Field("seed", _t("integer", minimum=INT64["minimum"], maximum=INT64["maximum"] - MAX_N)),
    Field("presence_penalty", _t("number", minimum=-2, maximum=2)),
    Field("frequency_penalty", _t("number", minimum=-2, maximum=2)),
    Field("logit_bias", _t("object", maxProperties=MAX_LOGIT_BIAS,
                           propertyNames={"pattern": "^[0-9]+$"},
                           additionalProperties={"type": "number", "minimum": -100,
                                                 "maximum": 100})),
    Field("logprobs", _LOGPROB_N, routes=frozenset({CMPL})),
    Field("logprobs", _t("boolean"), routes=frozenset({CHAT})),
    Field("top_logprobs", _LOGPROB_N, routes=frozenset({CHAT})),
    Field("echo", _t("boolean"),
          note="chat: the answer starts with the last message when it is the assistant's"),
    Field("stream", _t("boolean")),
    Field("stream_options", _t("object", properties={
        "include_usage": _t("boolean"), "continuous_usage_stats": _t("boolean")})),
    Field("user", _t("string")),
    Field("best_of", _t("integer", minimum=1, maximum=MAX_N), routes=frozenset({CMPL}),
          note="accepted when it equals n (one sample per choice); otherwise 400"),
    # ---- vLLM sampling ----
    Field("top_k", _t("integer", minimum=-1)),
    Field("min_p", _t("number", minimum=0, maximum=1)),
    Field("repetition_penalty", _t("number", minimum=REPETITION_PENALTY_RANGE[0],
                                   maximum=REPETITION_PENALTY_RANGE[1])),
    Field("min_tokens", _t("integer", minimum=0)),
    Field("stop_token_ids", _t("array", maxItems=MAX_STOP_TOKEN_IDS,
                               items={"type": "integer", "minimum": 0})),
    Field("ignore_eos", _t("boolean")),
    Field("include_stop_str_in_output", _t("boolean")),
    Field("skip_special_tokens", _t("boolean")),
    Field("prompt_logprobs", _LOGPROB_N),
    Field("truncate_prompt_tokens", _any_of({"type": "integer", "minimum": 1},
                                            {"const": -1})),
    Field("return_tokens_as_token_ids", _t("boolean")),
    Field("return_token_ids", _t("boolean")),
    Field("add_special_tokens", _t("boolean")),
    Field("priority", _t("integer", **INT64)),
    Field("request_id", _t("string", minLength=1, maxLength=MAX_REQUEST_ID)),
    Field("timeout", _t("number", exclusiveMinimum=0),
          note="pagedserve extension: seconds from arrival"),
    Field("length_penalty", _t("number"), Status.NO_EFFECT,
          note="only used by beam search, which is refused (vLLM ignores it without it)"),
    Field("include_reasoning", _t("boolean"), Status.NO_EFFECT, routes=frozenset({CHAT}),
          note="only used by a reasoning parser; none is configured (as vLLM without one)"),
    # ---- parsed by their own modules: api/requests/structured.py, api/requests/tools.py, api/chat_template.py
    _owned("response_format", _t("object")),
    _owned("structured_outputs", _t("object")),
    _owned("guided_json", _any_of({"type": "string"}, {"type": "object"})),
    _owned("guided_regex", _t("string")),
    _owned("guided_choice", _t("array")),
    _owned("guided_grammar", _t("string")),
    _owned("guided_decoding_backend", _t("string")),
    _owned("guided_whitespace_pattern", _t("string")),
    _owned("guided_json_object", _t("boolean")),
    _owned("tools", _t("array"), frozenset({CHAT})),
    _owned("tool_choice", _any_of({"type": "string"}, {"type": "object"}), frozenset({CHAT})),
    _owned("parallel_tool_calls", _t("boolean"), frozenset({CHAT})),
    _owned("chat_template", _t("string"), frozenset({CHAT})),
    _owned("chat_template_kwargs", _t("object"), frozenset({CHAT})),
    _owned("add_generation_prompt", _t("boolean"), frozenset({CHAT})),
    _owned("continue_final_message", _t("boolean"), frozenset({CHAT})),
    # ---- refused unless inert ----
    _refused("suffix", _NONE, "x", "the served models have no fill-in-the-middle"),
    _refused("structural_tag", _NONE, "{}", "structural tags are not implemented"),
    _refused("use_beam_search", _t("boolean", enum=[False, None]), True,
             "beam search is not implemented", False),
    _refused("spaces_between_special_tokens", _t("boolean", enum=[True, None]), False,
             "special tokens are always decoded as the tokenizer spells them", True),
    _refused("allowed_token_ids", _NONE, [1], "not implemented"),
    _refused("bad_words", _t("array", maxItems=0), ["x"], "not implemented", []),
    _refused("logits_processors", _t("array", maxItems=0), ["a.b"],
             "no server-side logits processors", []),
    _refused("prompt_embeds", _NONE, "AAAA", "prompts are text or token ids",
             routes=frozenset({CMPL})),
    _refused("cache_salt", _NONE, "salt", "the prefix cache is not salted"),
    _refused("kv_transfer_params", _NONE, {"a": 1}, "no disaggregated serving"),
    _refused("vllm_xargs", _NONE, {"a": 1}, "no custom extensions"),
    _refused("documents", _NONE, [{"title": "t", "text": "x"}],
             "the chat template gets no documents", routes=frozenset({CHAT})),
    _refused("mm_processor_kwargs", _t("object", maxProperties=0), {"a": 1},
             "text-only models", {}, routes=frozenset({CHAT})),
    _refused("media_io_kwargs", _t("object", maxProperties=0), {"a": 1},
             "text-only models", {}, routes=frozenset({CHAT})),
    _refused("reasoning_effort", _NONE, "low", "no reasoning models",
             routes=frozenset({CHAT})),
    _refused("functions", _t("array", maxItems=0), [{"name": "f"}],
             "the legacy functions API; use tools", [], routes=frozenset({CHAT})),
    _refused("function_call", _NONE, "auto", "the legacy functions API; use tool_choice",
             routes=frozenset({CHAT})),
    _refused("modalities", _t("array", items={"const": "text"}, minItems=1, maxItems=1),
             ["audio"],
             "text output only", ["text"], routes=frozenset({CHAT})),
    _refused("audio", _NONE, {"voice": "alloy"}, "text output only", routes=frozenset({CHAT})),
    _refused("prediction", _NONE, {"type": "content", "content": "x"},
             "no predicted outputs", routes=frozenset({CHAT})),
    _refused("web_search_options", _NONE, {}, "no web search", routes=frozenset({CHAT})),
    # OpenAI bookkeeping that does not change the answer (vLLM ignores it the same way)
    Field("store", _t("boolean"), Status.NO_EFFECT, routes=frozenset({CHAT}),
          note="nothing is stored"),
    Field("metadata", _t("object"), Status.NO_EFFECT, routes=frozenset({CHAT}),
          note="nothing is stored"),
    Field("service_tier", _t("string"), Status.NO_EFFECT, note="one tier"),
    Field("prompt_cache_key", _t("string"), Status.NO_EFFECT, routes=frozenset({CHAT}),
          note="the prefix cache needs no key (vLLM ignores it too)"),
    Field("safety_identifier", _t("string"), Status.NO_EFFECT, routes=frozenset({CHAT}),
          note="no per-user policy"),
)


def route_fields(route: str) -> dict[str, Field]:
    """The fields of one route ("completions" or "chat"), by name."""
    return {f.name: f for f in FIELDS if route in f.routes}


COMPLETION_FIELDS = route_fields(CMPL)
CHAT_FIELDS = route_fields(CHAT)
_PATHS = {CMPL: "/v1/completions", CHAT: "/v1/chat/completions"}


def check_fields(body: dict[str, Any], route: str) -> None:
    """400 for the first refused field that asks for something; one warning line for the
    fields nobody knows (they are ignored)."""
    known = COMPLETION_FIELDS if route == CMPL else CHAT_FIELDS
    for name, value in body.items():
        spec = known.get(name)
        if spec is None:
            continue
        if spec.status is Status.REFUSED and not is_inert(spec, value):
            raise bad_request(f"{name} is not supported by this server ({spec.note})",
                              param=name)
        # Fields parsed elsewhere (or not at all) still get their JSON type checked here.
        if spec.status in (Status.NO_EFFECT, Status.OWNED):
            _check_type(name, value, spec.schema)
    warn_unknown(body, known, _PATHS[route])


def check_field_types(body: dict[str, Any], schemas: dict[str, dict[str, Any]],
                      path: str) -> None:
    """For the routes without a Field table (/tokenize, /detokenize): each documented
    field's JSON type, a 400 naming it (a field the route then ignores, such as /tokenize's
    chat-template fields beside a prompt, is still held to its documented type); one
    warning line for the unknown ones."""
    for name, value in body.items():
        if name in schemas:
            _check_type(name, value, schemas[name])
    warn_unknown(body, schemas, path)


def _check_type(name: str, value: Any, schema: dict[str, Any]) -> None:
    """A 400 naming the field when its value is not of a JSON type its schema allows."""
    kinds = json_types(schema)
    if not _has_type(value, kinds):
        raise bad_request(f"{name} must be of type {' or '.join(kinds)}", param=name)


def is_inert(spec: Field, value: Any) -> bool:
    # type() and ==, not `in`: True == 1 and 1.0 == True in Python, not in JSON.
    return value is None or any(type(value) is type(v) and value == v for v in spec.inert)


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "boolean": (bool,), "string": (str,), "object": (dict,), "array": (list,),
    "integer": (int,), "number": (int, float), "null": (type(None),)}


def json_types(schema: dict[str, Any]) -> list[str]:
    """The JSON types a schema allows at its top level ("type", or its anyOf branches')."""
    if "anyOf" in schema:
        return [k for branch in schema["anyOf"] for k in json_types(branch)]
    kind = schema.get("type", [])
    return [kind] if isinstance(kind, str) else list(kind)


def _has_type(value: Any, kinds: list[str]) -> bool:
    """JSON type check (a bool is no number in JSON)."""
    for kind in kinds:
        if isinstance(value, _PY_TYPES[kind]) and not (
                isinstance(value, bool) and kind in ("integer", "number")):
            return True
    return False


def warn_unknown(body: dict[str, Any], known: dict[str, Any] | frozenset[str],
                 path: str) -> None:
    unknown = sorted(set(body) - set(known))
    if unknown:
        logger.warning("%s: the following fields were present in the request but ignored: "
                       "%s", path, ", ".join(unknown))
