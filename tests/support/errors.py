"""The one assertion for an OpenAI-style error body (every test that expects an error uses it)."""

from __future__ import annotations

from typing import Any


def check_error_body(body: Any) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}}: types checked; returns the inner
    object. `code` is a string or null (OpenAI's, not vLLM's integer status)."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error  # type: ignore[no-any-return]


def assert_error(r: Any, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """`r` (an httpx / TestClient response) is an error of `status` with the OpenAI body;
    `param` and `code` are checked when given. Returns the inner error object."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = check_error_body(r.json())
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error
