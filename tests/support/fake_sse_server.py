"""Fakes for the benchmark tests: a model-free OpenAI-style streaming server, in-process
(FakeSSE + app()) or as a subprocess (`python fake_sse_server.py --port P [--serial]
[--delay S]`), and a character tokenizer for the datasets.

Each request streams max_tokens one-word chunks, `delay` seconds apart; prompt "fail" gets a
500. --serial serves one request at a time behind a lock (a stand-in for the naive baseline),
so its throughput at concurrency 16 is far below the concurrent one's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


class FakeSSE:
    def __init__(self, delay: float = 0.01, serial: bool = False) -> None:
        self.delay = delay
        self.lock = asyncio.Lock() if serial else None
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict[str, Any]] = []

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if body["prompt"] == "fail":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        return StreamingResponse(self.events(body), media_type="text/event-stream")

    async def events(self, body: dict[str, Any]) -> AsyncIterator[str]:
        if self.lock is None:
            async for event in self._stream(body):
                yield event
            return
        async with self.lock:
            async for event in self._stream(body):
                yield event

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[str]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            n = body["max_tokens"]
            for i in range(n):
                await asyncio.sleep(self.delay)
                yield sse({"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]})
            yield sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            if body.get("stream_options", {}).get("include_usage"):
                yield sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


class CharTokenizer:
    """A stand-in for the HF tokenizer the datasets take: one token per character of a small
    alphabet (so decode/encode round-trips), id 0 a special token."""

    ALPHABET = "\x00abcdefghijklmnopqrstuvwxyz .,"

    def __init__(self) -> None:
        self.all_special_ids = [0]

    def __len__(self) -> int:
        return len(self.ALPHABET)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.ALPHABET.index(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.ALPHABET[i] for i in ids)


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def app(state: FakeSSE) -> Starlette:
    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    return Starlette(routes=[Route("/v1/completions", state.completions, methods=["POST"]),
                             Route("/health", health), Route("/v1/models", models)])


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay", type=float, default=0.005)
    p.add_argument("--serial", action="store_true")
    args = p.parse_args()
    uvicorn.run(app(FakeSSE(args.delay, args.serial)), host="127.0.0.1", port=args.port,
                log_level="error")


if __name__ == "__main__":
    main()
