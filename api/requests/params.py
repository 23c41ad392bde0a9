"""Reading a JSON request body and its fields with strict types.

JSON is loose (bools are ints in Python, NaN parses, numbers can be huge), so each getter
checks the exact type and range and raises a 400 that names the parameter. Which fields a
route knows, refuses or ignores: api/requests/fields.py.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from starlette.requests import Request

from api.errors import APIError, bad_request

logger = logging.getLogger("pagedserve.api")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MISSING: Any = object()


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past max_bytes, 400 for anything but an object."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        # JSON on the wire is UTF-8 (RFC 8259; a BOM is tolerated): json.loads(bytes) would
        # also guess UTF-16/32. NaN/Infinity are not JSON; Python accepts them unless told.
        body = json.loads(raw.decode("utf-8-sig"), parse_constant=_reject_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON value")


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than {max_bytes} bytes.",
                    code="request_too_large")


def get_int(body: dict[str, Any], name: str, default: Any = None, *, lo: int = INT64_MIN,
            hi: int = INT64_MAX) -> Any:
    """An int field in [lo, hi]; `default` (possibly None) when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    return check_int(value, name, lo, hi)


def check_int(value: Any, name: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", param=name)
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be in [{lo}, {hi}], got {value}", param=name)
    return value


def get_float(body: dict[str, Any], name: str, default: Any = None) -> Any:
    """A finite number; range checks are SamplingParams' job (its message names the field)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be a number", param=name)
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        raise bad_request(f"{name} is out of range", param=name) from None
    if not math.isfinite(number):
        raise bad_request(f"{name} must be a finite number", param=name)
    return number


def _get_typed(body: dict[str, Any], name: str, default: Any, kind: type, what: str) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise bad_request(f"{name} must be {what}", param=name)
    return value


def get_bool(body: dict[str, Any], name: str, default: Any = False) -> Any:
    return _get_typed(body, name, default, bool, "a boolean")


def get_str(body: dict[str, Any], name: str, default: Any = None) -> Any:
    return _get_typed(body, name, default, str, "a string")


def get_dict(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    result: dict[str, Any] | None = _get_typed(body, name, None, dict, "an object")
    return result


def get_int_list(body: dict[str, Any], name: str, lo: int = 0,
                 hi: int = INT64_MAX) -> list[int] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request(f"{name} must be a list of integers", param=name)
    return [check_int(v, name, lo, hi) for v in value]


def check_unicode(text: str, param: str) -> None:
    """A 400 naming `param` for text that is not valid Unicode: JSON allows a lone UTF-16
    surrogate ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{param} is not valid Unicode text: it contains a lone UTF-16 "
                          f"surrogate (U+{ord(text[e.start]):04X}) at character {e.start}",
                          param=param) from None


def check_unicode_in(value: Any, where: str) -> None:
    """check_unicode on every string (and key) inside a JSON value, the 400 naming the path
    to the first bad one (tools[0].function.name, stop, guided_choice[2]...)."""
    if isinstance(value, str):
        check_unicode(value, where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode_in(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, where)  # a bad key: the object that holds it
            check_unicode_in(item, f"{where}.{key}")
