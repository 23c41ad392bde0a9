"""FakeEngine: a faithful, torch-free EngineClient for API tests.

Tokens are characters (id = code point + 2; 0 = EOS, 1 = BOS). A request "generates" its
prompt's text tokens again, cycled, honouring max_tokens, stop strings, stop token ids,
logprobs and prompt logprobs; or, when `replies` is set, a scripted text (then EOS). It speaks the same contract as AsyncEngine (the same
RequestStream, the same admission refusals: tests/engine/test_engine_contract.py runs on
both). Delays, admission errors and mid-stream failures are knobs; aborts are recorded.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.outputs import ErrorCode, Logprob, RequestOutput, RequestTimings, TokenLogprobs
from engine.protocol import (
    ChatTemplateArgs,
    EngineDeadError,
    EngineLimits,
    EngineStats,
    EngineView,
    InvalidParamError,
    PromptTooLongError,
    RequestStream,
)
from engine.snapshot import (
    BLOCK_FREE,
    BLOCK_USED,
    SINGLE_ENGINE,
    STEP_LOG_LEN,
    EngineSnapshot,
    RequestRow,
    StepRecord,
)
from scheduler.sampling_params import SamplingParams

EOS, BOS, OFFSET = 0, 1, 2
MAX_ID = 0x110000 + OFFSET

# What the fake engine reports as every finished request's engine-side intervals
FAKE_TIMINGS = RequestTimings(queue=0.001, prefill=0.002, decode=0.03, inference=0.032)


def tok(c: str) -> int:
    return ord(c) + OFFSET


@dataclass
class Submitted:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    deadline: float | None = None


class FakeEngine:
    def __init__(self, *, max_model_len: int = 128, token_delay: float = 0.0,
                 load_delay: float = 0.0, start_error: Exception | None = None,
                 admission_error: Exception | None = None, fail_after: int | None = None,
                 mid_error: Exception | None = None, model_name: str = "fake-model") -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.token_delay = token_delay
        self.load_delay = load_delay
        self.start_error = start_error
        self.admission_error = admission_error  # raised by submit()
        self.fail_after = fail_after  # deltas before the mid-stream failure
        self.mid_error = mid_error  # None with fail_after: an output with .error set
        self.submitted: list[Submitted] = []
        self.aborted: list[str] = []  # streams closed before their final delta
        self.finished: list[str] = []  # requests that sent their final delta
        self.active: set[str] = set()
        self._runs: dict[str, asyncio.Task[None]] = {}
        self.dead = False
        self.started = False
        self.finish_rate: float | None = None  # EngineStats: drain rate and queue, for 429s
        self.num_waiting = 0
        self.shut_down = False
        self.cached_tokens = 0  # reported as each request's prefix-cache hit (num_cached_tokens)
        # Scripted output: the k-th submitted request says replies[k % len(replies)], one
        # character per delta, then stops with EOS (finish_reason "stop").
        self.replies: list[str] = []
        self.renders_tools = False  # whether the fake chat template has a tools section
        self.templates: list[ChatTemplateArgs] = []  # every apply_chat_template call
        # The live view: each generated token is a one-row decode step; requests by id:
        # (prompt tokens, output tokens, arrival).
        self.steps: collections.deque[StepRecord] = collections.deque(maxlen=STEP_LOG_LEN)
        self.progress: dict[str, list[float]] = {}
        self.looks = 0  # live_view calls

    @property
    def limits(self) -> EngineLimits | None:
        """None until started, as AsyncEngine's before its model is loaded."""
        if not self.started:
            return None
        return EngineLimits(max_model_len=self.max_model_len, num_kv_blocks=self.max_model_len,
                            block_size=1, vocab_size=MAX_ID, eos_token_ids=frozenset({EOS}),
                            max_prompt_bytes=4 * self.max_model_len)  # a token: 1 character

    async def start(self) -> None:
        await asyncio.sleep(self.load_delay)
        if self.start_error is not None:
            raise self.start_error
        self.started = True

    async def shutdown(self) -> None:
        self.shut_down = True
        self.started = False
        for task in list(self._runs.values()):
            task.cancel()

    def is_ready(self) -> bool:
        return self.started and not self.dead

    def _close(self, request_id: str) -> None:
        self.aborted.append(request_id)
        task = self._runs.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode(text, add_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        text.encode("utf-8")  # a lone surrogate raises, as in a real byte-level tokenizer
        return ([BOS] if add_special_tokens else []) + [tok(c) for c in text]

    async def detokenize(self, token_ids: list[int]) -> str:
        if any(t >= MAX_ID for t in token_ids):
            raise ValueError("token id out of range")
        return "".join(chr(t - OFFSET) for t in token_ids if t >= OFFSET)

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  args: ChatTemplateArgs | None = None) -> str:
        """`<role>content` lines; the request's template, kwargs and (when renders_tools)
        tools and tool_calls show up in the text so tests can see they arrived."""
        args = args if args is not None else ChatTemplateArgs()
        self.templates.append(args)
        if messages[-1]["content"] == "RAISE" or (args.chat_template or "").startswith("RAISE"):
            raise ValueError("Conversation roles must alternate")  # like a jinja template
        head = f"[{args.chat_template}]" if args.chat_template is not None else ""
        head += "".join(f"[{k}={v}]" for k, v in sorted(args.kwargs.items()))
        if args.tools and self.renders_tools:
            head += f"<tools>{json.dumps(args.tools)}\n"
        text = head + "".join(f"<{m['role']}>{m['content']}{self._calls(m)}\n"
                              for m in messages)
        if args.continue_final_message:
            return text[:-1]
        return text + ("<assistant>" if args.add_generation_prompt else "")

    def _calls(self, message: dict[str, Any]) -> str:
        calls = message.get("tool_calls")
        return f"<calls>{json.dumps(calls)}" if calls and self.renders_tools else ""

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.active), num_waiting=self.num_waiting,
                           num_kv_blocks=100, num_free_kv_blocks=75, num_preemptions=3,
                           prefix_cache_queries=10, prefix_cache_hits=4, num_steps=7,
                           finish_rate=self.finish_rate)

    async def live_view(self, since: dict[str, int]) -> list[EngineView]:
        """The fake's pool: num_kv_blocks 100, the first 25 used (as stats() says)."""
        if self.dead or not self.started:
            raise EngineDeadError("engine is dead")
        self.looks += 1
        after = since.get(SINGLE_ENGINE, 0)
        now = time.monotonic()
        rows = tuple(RequestRow(rid, "running", int(p), int(o), self.cached_tokens,
                                (now - t) * 1e3, None, None)
                     for rid, (p, o, t) in self.progress.items())
        snapshot = EngineSnapshot(tuple(s for s in self.steps if s.step > after),
                                  BLOCK_USED * 25 + BLOCK_FREE * 75, rows, len(rows))
        return [EngineView(SINGLE_ENGINE, self.stats(), snapshot)]

    def _stepped(self, rid: str, produced: int) -> None:
        step = self.steps[-1].step + 1 if self.steps else 1
        self.steps.append(StepRecord(step, time.time(), self.token_delay * 1e3, 1, 0, 0, 0))
        if rid in self.progress:
            self.progress[rid][1] = produced

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                     priority: int = 0, deadline: float | None = None) -> RequestStream:
        if self.dead or not self.started:
            raise EngineDeadError("engine is dead")
        if self.admission_error is not None:
            raise self.admission_error
        if len(prompt) >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {len(prompt)} tokens; max_model_len is "
                                     f"{self.max_model_len}")
        bad = next((t for t in prompt if not 0 <= t < MAX_ID), None)
        if bad is not None:
            raise InvalidParamError("prompt", f"prompt token id {bad} is out of range")
        if request_id in self._runs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.submitted.append(Submitted(request_id, prompt, params, priority, deadline))
        stream = RequestStream(request_id, self._close)
        script = self.replies[(len(self.submitted) - 1) % len(self.replies)] \
            if self.replies else None
        run = _Run(self, request_id, list(prompt), params, deadline, script)
        self._runs[request_id] = asyncio.create_task(self._feed(run, stream))
        return stream

    async def _feed(self, run: _Run, stream: RequestStream) -> None:
        """Generate into the stream, as the engine thread would."""
        self.active.add(run.rid)
        self.progress[run.rid] = [len(run.ids), 0, time.monotonic()]
        try:
            async for out in run.outputs():
                stream.put(out)
                if out.finished:
                    self.finished.append(run.rid)
        except asyncio.CancelledError:
            if self.shut_down:
                stream.put(EngineDeadError("server shutting down"))
            raise
        except Exception as e:  # noqa: BLE001 - a mid-stream failure, as the stream raises it
            stream.put(e)
        finally:
            self.active.discard(run.rid)
            self.progress.pop(run.rid, None)
            self._runs.pop(run.rid, None)


class _Run:
    """One request's generation."""

    def __init__(self, engine: FakeEngine, request_id: str, ids: list[int],
                 params: SamplingParams, deadline: float | None,
                 script: str | None = None) -> None:
        self.e, self.rid, self.ids, self.p = engine, request_id, ids, params
        self.deadline = deadline
        self.reply = [t for t in ids if t >= OFFSET] or [tok("x")]
        if script is not None:
            self.reply = [tok(c) for c in script] + [EOS]
        self.text = ""

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        # An empty delta with the prompt, like a prefill chunk: the API must not emit it.
        yield RequestOutput(self.rid, (), "", prompt_token_ids=tuple(self.ids),
                            prompt_logprobs=self._prompt_logprobs(),
                            num_prompt_tokens=len(self.ids),
                            num_cached_tokens=self.e.cached_tokens)
        if self.p.max_tokens == 0:
            yield self._out((), "", "length", None, 0)
            return
        for k in range(self.p.max_tokens):
            await asyncio.sleep(self.e.token_delay)
            if self.deadline is not None and time.monotonic() >= self.deadline:
                yield self._timed_out(k)  # as LLMEngine: the first token is "scheduled"
                return
            if self.e.fail_after is not None and k >= self.e.fail_after:
                if self.e.mid_error is not None:
                    raise self.e.mid_error
                yield RequestOutput(self.rid, (), "", finish_reason="abort", error="boom",
                                    error_code=ErrorCode.STEP_FAILED)
                return
            out = self._step(self.reply[k % len(self.reply)], k + 1)
            self.e._stepped(self.rid, k + 1)
            yield out
            if out.finished:
                return

    def _timed_out(self, produced: int) -> RequestOutput:
        if produced == 0:
            return RequestOutput(self.rid, (), "", finish_reason="abort",
                                 error="timed out in the queue",
                                 error_code=ErrorCode.QUEUE_TIMEOUT)
        return self._out((), "", "timeout", None, produced)

    def _step(self, t: int, produced: int) -> RequestOutput:
        if t == EOS:
            return self._out((t,), "", "stop", None, produced)
        if t in self.p.stop_token_ids:
            return self._out((t,), "", "stop", t, produced)
        new = chr(t - OFFSET)
        for s in self.p.stop:
            if (self.text + new).endswith(s):
                keep = new if self.p.include_stop_str_in_output else ""
                return self._out((t,), keep, "stop", s, produced)
        self.text += new
        done = "length" if produced >= self.p.max_tokens else None
        return self._out((t,), new, done, None, produced)

    def _out(self, ids: tuple[int, ...], text: str, finish: str | None,
             stop: int | str | None, produced: int) -> RequestOutput:
        lps = tuple(self._lp(t) for t in ids) if self.p.logprobs is not None else None
        return RequestOutput(self.rid, ids, text, finish_reason=finish, stop_reason=stop,
                             logprobs=lps, num_prompt_tokens=len(self.ids),
                             num_output_tokens=produced,
                             num_cached_tokens=self.e.cached_tokens,
                             queue_time=0.001 if finish else None,
                             timings=FAKE_TIMINGS if finish else None)

    def _lp(self, t: int, n: int | None = None) -> TokenLogprobs:
        n = self.p.logprobs if n is None else n
        chosen = Logprob(t, chr(max(t - OFFSET, 0)), -0.5)
        top = tuple(Logprob(t + k, chr(max(t + k - OFFSET, 0)), -0.5 - k)
                    for k in range(n or 0))
        return TokenLogprobs(chosen, 1, top)

    def _prompt_logprobs(self) -> tuple[TokenLogprobs | None, ...] | None:
        n = self.p.prompt_logprobs
        if n is None:
            return None
        return (None, *(self._lp(t, n) for t in self.ids[1:]))
