"""api/sse.py's framing: one `data:` line per event, whatever the text holds."""

from __future__ import annotations

import json

import httpx
import pytest

from api.sse import _event

TEXTS = ["plain", "a\u2028b", "c\u2029d", "e\x85f", "tab\tnew\nline\rcr\x0bvt\x0cff\x1cfs\x1e",
         "é 中文 🙂", "\u2028\u2029\x85" * 3]


@pytest.mark.parametrize("text", TEXTS)
def test_an_event_is_one_line_that_decodes_to_the_same_text(text: str) -> None:
    payload = {"choices": [{"text": text}]}
    raw = _event(payload).encode()
    # Every way a client may split lines: SSE's own (CR, LF, CRLF) and str.splitlines, which
    # httpx's aiter_lines uses (it also breaks at U+0085, U+2028 and U+2029).
    decoded = raw.decode()
    assert decoded.endswith("\n\n") and decoded.count("\n") == 2
    assert [ln for ln in decoded.splitlines() if ln] == [decoded.split("\n")[0]]
    line = decoded.split("\n")[0]
    assert line.startswith("data: ") and json.loads(line[6:]) == payload


def test_httpx_reads_such_a_stream_line_by_line() -> None:
    body = b"".join(_event({"text": t}).encode() for t in TEXTS)
    lines = [ln for ln in httpx.Response(200, content=body).iter_lines() if ln]
    assert [json.loads(ln[6:])["text"] for ln in lines] == TEXTS
