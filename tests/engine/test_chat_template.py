"""Chat rendering through transformers' real apply_chat_template: the chat-template request
fields, tools in a template that has a tools section, and the default tools prompt for one
that has none (SmolLM2's), through the API's render_chat."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from api.chat_template import render_chat
from api.errors import APIError
from api.requests.tools import ToolConfig, parse_tools
from engine.protocol import ChatTemplateArgs, EngineStats
from engine.tokenizer import Tokenizer
from tests.support.models import build_tokenizer

# A Hermes/Qwen-style template: tools in the system turn, calls and results in the history.
TOOLS_TEMPLATE = (  # transformers trims a newline after a block tag: newlines are explicit
    "{%- if tools %}<|im_start|>system{{ '\\n' }}Tools:{% for t in tools %}{{ '\\n' }}"
    "{{ t | tojson }}{% endfor %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}:"
    "{{ c.function.arguments.city }}</tool_call>{% endfor %}"
    "<|im_end|>{{ '\\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY: list[dict[str, Any]] = [*USER, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "18C"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from transformers import AutoTokenizer

    folder: Path = tmp_path_factory.mktemp("chat-template-tok")
    build_tokenizer(folder)  # ChatML, no tools section
    return Tokenizer(AutoTokenizer.from_pretrained(folder))


class TokenizerEngine:
    """The two EngineClient methods render_chat uses, straight on a Tokenizer."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  args: ChatTemplateArgs | None = None) -> str:
        return self.tok.render_chat(messages, args or ChatTemplateArgs())

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens)

    def stats(self) -> EngineStats:
        return EngineStats()


def rendered(tok: Tokenizer, messages: list[dict[str, Any]], tools: ToolConfig | None = None,
             **fields: Any) -> str:
    from api.chat_template import parse_template_fields
    args = parse_template_fields(fields, trusted=True)
    ids = asyncio.run(render_chat(TokenizerEngine(tok), messages, args, tools))  # type: ignore[arg-type]
    return tok.decode(ids, skip_special_tokens=False)


def weather_tools() -> ToolConfig | None:
    return parse_tools({"tools": [WEATHER]})


def test_request_template_renders_tools_and_history(tiny: Tokenizer) -> None:
    text = rendered(tiny, HISTORY, weather_tools(), chat_template=TOOLS_TEMPLATE)
    assert text == (
        '<|im_start|>system\nTools:\n{"type": "function", "function": {"name": "get_weather", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}'
        "<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        "<tool_call>get_weather:Paris</tool_call><|im_end|>\n<|im_start|>tool\n18C<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_template_without_tools_gets_the_default_prompt(tiny: Tokenizer) -> None:
    text = rendered(tiny, HISTORY, weather_tools())
    assert text.startswith("<|im_start|>system\nYou can call functions")
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in text
    assert "<|im_start|>tool\n<tool_response>\n18C\n</tool_response><|im_end|>\n" in text


def test_smollm2_template_has_no_tools_section(smol: Tokenizer) -> None:
    args = ChatTemplateArgs(tools=[WEATHER])
    assert smol.render_chat(USER, args) == smol.render_chat(USER, ChatTemplateArgs())
    text = rendered(smol, USER, weather_tools())
    # The tools prompt is the system message (in place of SmolLM2's default one).
    assert text.startswith("<|im_start|>system\nYou can call functions")
    assert "SmolLM" not in text and text.endswith("Weather in Paris?<|im_end|>\n"
                                                   "<|im_start|>assistant\n")


def test_generation_prompt_and_continue_final_message(tiny: Tokenizer) -> None:
    partial = [*USER, {"role": "assistant", "content": "It is"}]
    assert rendered(tiny, USER, add_generation_prompt=False) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n")
    text = rendered(tiny, partial, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nIt is")  # left open: no <|im_end|>
    closed = rendered(tiny, partial, add_generation_prompt=False)
    assert closed.endswith("<|im_start|>assistant\nIt is<|im_end|>\n")


def test_chat_template_kwargs(tiny: Tokenizer) -> None:
    plain = rendered(tiny, USER, chat_template=TOOLS_TEMPLATE)
    assert plain.endswith("<|im_start|>assistant\n")
    off = rendered(tiny, USER, chat_template=TOOLS_TEMPLATE,
                   chat_template_kwargs={"enable_thinking": False})
    assert off == plain + "<think></think>"


@pytest.mark.parametrize("template", ["{% for m in messages %}", "{{ raise_exception('no') }}",
                                      "{{ messages[0].nope.deeper }}"])
def test_broken_request_template_is_a_400(tiny: Tokenizer, template: str) -> None:
    with pytest.raises(APIError) as e:
        rendered(tiny, USER, chat_template=template)
    assert (e.value.status, e.value.param) == (400, "chat_template")


def test_request_template_works_without_a_model_template(tiny: Tokenizer) -> None:
    bare = Tokenizer(tiny.hf.__class__(tokenizer_object=tiny.hf.backend_tokenizer))
    assert not bare.has_chat_template
    with pytest.raises(APIError) as e:
        rendered(bare, USER)
    assert e.value.param == "messages"
    assert rendered(bare, USER, chat_template="{{ messages[0].content }}!") == (
        "Weather in Paris?!")
