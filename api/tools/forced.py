"""Reading the output of a forced tool call (tool_choice "required" or a named function),
which the grammar built by api/requests/tools.py has shaped; same interface as parser.py.

- Named function: the output is the arguments object itself, so every text delta is an
  arguments fragment of call 0, as vLLM streams it.
- "required": the output is a JSON array of {"name", "parameters"} objects. Each element is
  sent as one call delta when its closing brace arrives. Should the output hold no call at
  all (cut by max_tokens before the first element closed, or no grammar applied), the text
  comes back as content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from api.tools.parser import CallDelta, Parsed, new_call_id


@dataclass
class NamedParser:
    name: str
    call_id: str = field(default_factory=new_call_id)
    started: bool = False

    def feed(self, text: str) -> Parsed:
        if not text:
            return Parsed()
        first, self.started = not self.started, True
        if first:
            return Parsed(calls=(CallDelta(0, text, self.call_id, self.name),))
        return Parsed(calls=(CallDelta(0, text),))

    def finish(self) -> Parsed:
        return Parsed()


@dataclass
class RequiredParser:
    raw: list[str] = field(default_factory=list)  # everything, for the no-call fallback
    element: list[str] = field(default_factory=list)  # the array element being read
    depth: int = 0  # JSON nesting depth; the array itself is depth 1
    in_string: bool = False
    escaped: bool = False
    num_calls: int = 0

    def feed(self, text: str) -> Parsed:
        self.raw.append(text)
        calls: list[CallDelta] = []
        for ch in text:
            if self.depth >= 2:
                self.element.append(ch)
            if self._step(ch):
                calls.extend(self._end_element())
        return Parsed(calls=tuple(calls))

    def _step(self, ch: str) -> bool:
        """Advance the scanner by one character; True when an array element just closed."""
        if self.in_string:
            self.in_string = self.escaped or ch != '"'
            self.escaped = not self.escaped and ch == "\\"
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
            if self.depth == 2:
                self.element = [ch]
        elif ch in "]}":
            self.depth -= 1
            return self.depth == 1 and ch == "}"
        return False

    def _end_element(self) -> list[CallDelta]:
        try:
            value = json.loads("".join(self.element))
        except ValueError:
            return []
        if not isinstance(value, dict):
            return []
        name, params = value.get("name"), value.get("parameters")
        if not isinstance(name, str) or not isinstance(params, dict):
            return []
        self.num_calls += 1
        return [CallDelta(self.num_calls - 1, json.dumps(params, ensure_ascii=False),
                          new_call_id(), name)]

    def finish(self) -> Parsed:
        return Parsed(content="".join(self.raw)) if self.num_calls == 0 else Parsed()
