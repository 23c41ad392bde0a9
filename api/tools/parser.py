"""Reading tool calls out of generated text, incrementally (one parser per choice).

A parser is fed the text deltas of one choice and answers what to send: content text and
tool-call deltas in OpenAI's streaming shape (a call's first delta has its id and name).
`finish()` flushes what was held back. Feeding the whole text at once and finishing gives
the non-streamed answer, so streamed and non-streamed replies agree by construction.

HermesParser (tool_choice "auto") reads `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks. A block is sent as one call delta once it is closed and parses: a
block that turns out malformed stays content text, which could not be taken back had its
arguments been streamed. Text that may be the start of a `<tool_call>` tag is held back.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

START, END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class CallDelta:
    """Part of tool call `index`: the first part carries id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str = ""
    calls: tuple[CallDelta, ...] = ()

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(self.content + other.content, self.calls + other.calls)


class OutputParser(Protocol):
    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


def call_arguments(value: Any) -> str | None:
    """A Hermes block's JSON as the call's arguments string, or None when it is not a call
    ({"name": a non-empty string, "arguments": an object or a JSON object string; some
    models write "parameters", read the same way; neither: no arguments})."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
            or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def _block_call(block: str) -> tuple[str, str] | None:
    """(name, arguments) of the text between the tags, or None when malformed."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    args = call_arguments(value)
    return (value["name"], args) if args is not None else None


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class HermesParser:
    """`auto` mode. Whitespace between content and calls is held until more content
    follows; at the end it is dropped if any call was made (so a reply that is only calls
    has no content)."""

    pending: str = ""  # text not yet classified (outside: a possible partial start tag)
    inside: bool = False  # within an open <tool_call> block
    held_space: str = ""  # trailing whitespace of the content sent so far
    num_calls: int = 0
    # parallel_tool_calls false: 1. Later calls are dropped (neither calls nor content), as
    # vLLM keeps only the first; OpenAI's contract is "at most one call".
    max_calls: int | None = None
    _out: list[str] = field(default_factory=list)

    def feed(self, text: str) -> Parsed:
        self.pending += text
        calls: list[CallDelta] = []
        while True:
            tag = END if self.inside else START
            at = self.pending.find(tag)
            if at < 0:
                break
            block, self.pending = self.pending[:at], self.pending[at + len(tag):]
            if self.inside:
                calls.extend(self._close(block))
            else:
                self._content(block)
            self.inside = not self.inside
        if not self.inside:
            keep = _partial_tag(self.pending, START)
            self._content(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
        return self._emit(calls)

    def finish(self) -> Parsed:
        calls: list[CallDelta] = []
        if self.inside:  # never closed: a call if what came is whole (EOS before the tag)
            calls.extend(self._close(self.pending, closed=False))
        else:
            self._content(self.pending)
        self.pending, self.inside = "", False
        if self.num_calls == 0:
            self._out.append(self.held_space)
        self.held_space = ""
        return self._emit(calls)

    def _close(self, block: str, closed: bool = True) -> list[CallDelta]:
        call = _block_call(block)
        if call is None:
            self._content(START + block + (END if closed else ""))
            return []
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return []
        self.num_calls += 1
        return [CallDelta(self.num_calls - 1, call[1], new_call_id(), call[0])]

    def _content(self, text: str) -> None:
        text = self.held_space + text
        core = text.rstrip()
        if core:
            self._out.append(core)
        self.held_space = text[len(core):]

    def _emit(self, calls: list[CallDelta]) -> Parsed:
        content, self._out = "".join(self._out), []
        return Parsed(content, tuple(calls))
