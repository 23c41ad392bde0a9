"""Tool calls in chat answers: one output parser per choice, the message with tool_calls,
the stream's tool-call deltas and the finish_reason "tool_calls"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from api.requests.tools import ToolConfig
from api.tools.forced import NamedParser, RequiredParser
from api.tools.parser import CallDelta, HermesParser, OutputParser, Parsed


def make_parser(config: ToolConfig | None) -> OutputParser | None:
    """None: the text is plain content (no tools, or tool_choice "none")."""
    if config is None or config.mode == "none":
        return None
    if config.mode == "function":
        assert config.forced_name is not None
        return NamedParser(config.forced_name)
    if config.mode == "required":  # its schema already holds one call when not parallel
        return RequiredParser()
    return HermesParser(max_calls=None if config.parallel else 1)


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's "tool_calls" when the model stopped after calling; "length" (cut short)
    and the rest stay as they are."""
    return "tool_calls" if made_calls and reason == "stop" else reason


@dataclass
class ToolCalls:
    """One choice's parsed output so far: content and the calls (merged from deltas)."""

    parser: OutputParser
    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str, finished: bool) -> Parsed:
        parsed = self.parser.feed(text)
        if finished:
            parsed += self.parser.finish()
        self.content.append(parsed.content)
        for delta in parsed.calls:
            self._merge(delta)
        return parsed

    def _merge(self, delta: CallDelta) -> None:
        """A first delta opens call `index` (indexes come in order); later ones extend its
        arguments."""
        if delta.id is not None:
            self.calls.append({"id": delta.id, "type": "function",
                               "function": {"name": delta.name, "arguments": ""}})
        self.calls[delta.index]["function"]["arguments"] += delta.arguments

    def message(self) -> dict[str, Any]:
        text = "".join(self.content)
        if not self.calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": text or None, "tool_calls": self.calls}


def stream_delta(parsed: Parsed) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.calls:
        delta["tool_calls"] = [c.to_json() for c in parsed.calls]
    return delta
