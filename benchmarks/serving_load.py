"""Sending a load and measuring it, in the `vllm bench serve` vocabulary (used by loadgen.py
and compare.py).

One request = one streamed POST /v1/completions. Per request we record the time to the first
content chunk (TTFT), the gaps between later content chunks (ITL), the end-to-end latency
(E2EL, to the end of the stream) and the completion tokens the server reports in `usage`.
Aggregates follow vLLM's `calculate_metrics`: TPOT = (E2EL - TTFT) / (output tokens - 1) per
request with more than one output token; throughputs divide by the wall time of the whole run;
goodput counts the requests that meet every given SLO (TTFT, TPOT, E2EL in ms) per second.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

PERCENTILES = (50.0, 90.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2el")  # what --goodput accepts, as in vLLM


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    prompt_len: int  # tokens, as our tokenizer counts them
    output_len: int  # max_tokens


@dataclass(frozen=True)
class RequestResult:
    success: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False  # False: output_tokens counts content chunks instead
    ttft: float = 0.0
    itl: tuple[float, ...] = ()
    latency: float = 0.0
    finish_reason: str | None = None


@dataclass
class _Stream:
    """Mutable state while one response streams in."""
    start: float
    ttft: float = 0.0
    last: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: str = ""

    def on_event(self, data: dict[str, Any], now: float) -> None:
        if "error" in data:
            self.error = json.dumps(data["error"])[:300]
            return
        if data.get("usage"):
            self.usage = data["usage"]
        for choice in data.get("choices") or []:
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            if not choice.get("text"):
                continue  # a finish or usage chunk carries no content: no TTFT/ITL sample
            if self.chunks == 0:
                self.ttft = now - self.start
            else:
                self.itl.append(now - self.last)
            self.last = now
            self.chunks += 1


async def send_request(client: httpx.AsyncClient, url: str, spec: RequestSpec,
                       extra_body: dict[str, Any]) -> RequestResult:
    """Stream one completion; never raises for server or transport errors."""
    body = {"prompt": spec.prompt, "max_tokens": spec.output_len, "temperature": 0.0,
            "stream": True, **extra_body}
    st = _Stream(start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                return RequestResult(success=False, error=f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                st.on_event(json.loads(payload), time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(success=False, error=f"{e.__class__.__name__}: {e}")
    return _finish(st, spec, time.perf_counter() - st.start)


def _finish(st: _Stream, spec: RequestSpec, latency: float) -> RequestResult:
    if st.error or st.chunks == 0:
        return RequestResult(success=False, error=st.error or "no content chunk in the stream")
    usage = st.usage or {}
    out = usage.get("completion_tokens")
    return RequestResult(success=True, prompt_tokens=usage.get("prompt_tokens", spec.prompt_len),
                         output_tokens=out if out is not None else st.chunks,
                         usage_reported=out is not None, ttft=st.ttft, itl=tuple(st.itl),
                         latency=latency, finish_reason=st.finish_reason)


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start). Gamma-distributed gaps with shape `burstiness` (1 =
    Poisson) and mean 1/rate, rescaled so the schedule spans n / rate as vLLM does;
    rate inf = all at once, burstiness inf = constant spacing."""
    if math.isinf(request_rate) or n == 0:
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    cum = np.cumsum(gaps)
    cum *= (n / request_rate) / cum[-1]
    return [0.0, *cum[:-1].tolist()]  # the first request goes at once


async def run_load(base_url: str, specs: Sequence[RequestSpec], *, request_rate: float = math.inf,
                   burstiness: float = 1.0, max_concurrency: int | None = None,
                   extra_body: dict[str, Any] | None = None, seed: int = 0,
                   desc: str | None = None) -> tuple[list[RequestResult], float]:
    """Send every spec on its arrival schedule, at most max_concurrency in flight.
    -> (results in spec order, wall seconds from the first send to the last response)."""
    from tqdm.asyncio import tqdm

    url = base_url.rstrip("/") + "/v1/completions"
    offsets = arrival_offsets(len(specs), request_rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(specs) or 1)
    bar = tqdm(total=len(specs), desc=desc, disable=desc is None, leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            if sem is None:
                res = await send_request(client, url, spec, extra_body or {})
            else:
                async with sem:
                    res = await send_request(client, url, spec, extra_body or {})
            bar.update(1)
            return res

        results = await asyncio.gather(*(one(s, o) for s, o in zip(specs, offsets)))
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def _stats_ms(name: str, xs: Sequence[float]) -> dict[str, float]:
    """mean/median/std and p50/p90/p99 in ms (median and p50 are the same number: vLLM
    prints the first, the comparison tables use the second)."""
    arr = np.asarray(xs, dtype=float) * 1000.0  # s -> ms
    keys = [f"{k}_{name}_ms" for k in ("mean", "median", "std")]
    keys += [f"p{p:g}_{name}_ms" for p in PERCENTILES]
    if arr.size == 0:
        return dict.fromkeys(keys, float("nan"))
    values = [arr.mean(), np.median(arr), arr.std(), *np.percentile(arr, PERCENTILES)]
    return {k: float(v) for k, v in zip(keys, values)}


def request_tpot(r: RequestResult) -> float:
    """Seconds per output token after the first; 0 for a one-token answer (vLLM's rule)."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:100"] -> {"ttft": 500.0, "tpot": 100.0} (milliseconds)."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {SLO_METRICS}, got {item!r}")
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {value}")
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    measured_ms = {"ttft": r.ttft * 1000, "tpot": request_tpot(r) * 1000, "e2el": r.latency * 1000}
    return r.success and all(measured_ms[k] <= v for k, v in slos.items())


def compute_metrics(results: Sequence[RequestResult], duration: float,
                    slos: dict[str, float] | None = None) -> dict[str, Any]:
    """vLLM's aggregate metrics over one run (latencies in ms, throughputs per second);
    request_goodput only when SLOs are given."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [request_tpot(r) for r in ok if r.output_tokens > 1]
    m: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "output_lens": [r.output_tokens for r in ok],
        "usage_reported": all(r.usage_reported for r in ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
    }
    if slos:
        m["goodput_slos_ms"] = dict(slos)
        m["request_goodput"] = sum(meets_slos(r, slos) for r in ok) / duration
    m |= _stats_ms("ttft", [r.ttft for r in ok])
    m |= _stats_ms("tpot", tpots)
    m |= _stats_ms("itl", [x for r in ok for x in r.itl])
    m |= _stats_ms("e2el", [r.latency for r in ok])
    return m
