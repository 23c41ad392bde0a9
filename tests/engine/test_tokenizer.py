"""Tokenizer facade and IncrementalDetokenizer, on SmolLM2's real byte-level BPE tokenizer
and on a SentencePiece-style tokenizer (Metaspace + byte fallback) built in-process."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer, Tokenizer
from scheduler.sampling_params import SamplingParams
from tests.support.sp_tokenizer import sentencepiece_tokenizer

SAMPLES = [
    "Hello world, this is a streaming test.",
    "Emoji 😀👍🏽 and flags 🇫🇷 mid-sentence.",
    "中文文本，日本語のテキスト、한국어 텍스트.",
    "  leading spaces\n\nnew lines\ttabs and café naïve",
    "x" * 50 + " done",
]
HYPO = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="session")
def sp() -> Tokenizer:
    """A Llama-style SentencePiece tokenizer: '▁' for spaces, <0xNN> byte fallback pieces."""
    return sentencepiece_tokenizer([s for s in SAMPLES if s.isascii()] * 10)


def stream(tok: Tokenizer, prompt: Sequence[int], chunks: Sequence[Sequence[int]],
           params: SamplingParams | None = None) -> tuple[list[str], str | None]:
    """Run a detokenizer over the chunks the way the engine does: deltas, then flush."""
    detok = IncrementalDetokenizer(tok, prompt, params or SamplingParams())
    deltas: list[str] = []
    for chunk in chunks:
        delta, stop = detok.step(chunk)
        deltas.append(delta)
        if stop is not None:
            assert detok.flush() == ""
            return deltas, stop
    deltas.append(detok.flush())
    return deltas, None


def split(ids: Sequence[int], rng: random.Random, max_chunk: int = 4) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        chunks.append(list(ids[i:i + n]))
        i += n
    return chunks


def ones(ids: Sequence[int]) -> list[list[int]]:
    return [[i] for i in ids]


def chat_prompt(tok: Tokenizer) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    return tok.encode(text)


# --- Tokenizer ---------------------------------------------------------------------------

def test_smol_basics(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert smol.has_chat_template
    im_end = smol.encode("<|im_end|>")
    assert im_end == [2] and 2 in smol.eos_token_ids
    assert Tokenizer(smol.hf, eos_token_ids=[7, 9]).eos_token_ids == frozenset({2, 7, 9})
    for text in SAMPLES:
        assert smol.decode(smol.encode(text)) == text
    assert smol.decode([*smol.encode("hi"), 2], skip_special_tokens=False) == "hi<|im_end|>"
    assert smol.decode([*smol.encode("hi"), 2]) == "hi"
    # Tokenization spaces are never "cleaned up": the model's text comes back as it is.
    assert smol.decode(smol.encode("a , b .")) == "a , b ."


def test_token_text_byte_level(smol: Tokenizer) -> None:
    hello, world = smol.encode("Hello world")
    assert (smol.token_text(hello), smol.token_text(world)) == ("Hello", " world")
    pieces = [smol.token_text(i) for i in smol.encode(" 😀")]
    assert pieces == ["bytes:\\x20\\xf0\\x9f\\x98", "bytes:\\x80"]
    assert smol.token_text(2) == "<|im_end|>"
    assert "".join(smol.token_text(i) for i in smol.encode("café 中")) != ""


def test_token_text_sentencepiece(sp: Tokenizer) -> None:
    ids = sp.encode("Hello ö", add_special_tokens=False)
    texts = [sp.token_text(i) for i in ids]
    assert texts[0].startswith(" ") and "".join(texts[:-2]).strip() == "Hello"
    assert texts[-2:] == ["bytes:\\xc3", "bytes:\\xb6"]


def test_chat_template_chatml(smol: Tokenizer) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert smol.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n")
    no_system = smol.apply_chat_template([{"role": "user", "content": "Hi"}],
                                         add_generation_prompt=False)
    assert no_system.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert no_system.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_chat_template_missing_or_raising(sp: Tokenizer) -> None:
    assert not sp.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        sp.apply_chat_template([{"role": "user", "content": "hi"}])
    hf = sp.hf.__class__(tokenizer_object=sp.hf.backend_tokenizer)
    hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    strict = Tokenizer(hf)
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])


# --- IncrementalDetokenizer without stop strings ----------------------------------------

@pytest.mark.parametrize("text", SAMPLES)
def test_deltas_add_up_for_any_split(smol: Tokenizer, text: str) -> None:
    ids, prompt = smol.encode(text), chat_prompt(smol)
    rng = random.Random(text)
    for chunks in [ones(ids), [ids], *(split(ids, rng) for _ in range(5))]:
        deltas, _ = stream(smol, prompt, chunks)
        assert "".join(deltas) == smol.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_is_held_back(smol: Tokenizer) -> None:
    ids = smol.encode("a😀")  # 'a', then the emoji's 4 bytes spread over several tokens
    assert len(ids) >= 3
    detok = IncrementalDetokenizer(smol, [], SamplingParams())
    steps = [detok.step([i]) for i in ids]
    assert steps == [("a", None)] + [("", None)] * (len(ids) - 2) + [("😀", None)]
    assert detok.flush() == ""


def test_finished_characters_before_an_unfinished_one_go_out_at_once(smol: Tokenizer) -> None:
    """Chunks that each end inside a character still emit every whole character at once."""
    text = "000\x8000ࠀࠀ0ఀ𐀀 and 😀😀😀 中中"  # rare characters: one byte per token
    ids = smol.encode(text)
    chunks = [ids[i:i + 4] for i in range(0, len(ids), 4)]
    deltas, _ = stream(smol, [], chunks)
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    detok = IncrementalDetokenizer(smol, [], SamplingParams())
    assert detok.step(smol.encode("ok 😀")[:-1]) == ("ok", None)
    many = smol.encode("😀" * 30)
    assert len(many) > MAX_PENDING_TOKENS
    detok = IncrementalDetokenizer(smol, [], SamplingParams())
    assert detok.step(many[:-1]) == ("😀" * 29, None)
    assert (detok.step(many[-1:]), detok.flush()) == (("😀", None), "")


def test_flush_returns_unfinished_tail(smol: Tokenizer) -> None:
    ids = smol.encode("ok 😀")[:-1]  # the request ended (length) inside the emoji
    deltas, _ = stream(smol, [], ones(ids))
    assert deltas[-1] == smol.decode(ids[-1:]) == " \ufffd"
    assert "".join(deltas) == smol.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(smol: Tokenizer, skip: bool) -> None:
    ids = [*smol.encode("One"), 1, 2, 2, *smol.encode(" two 中"), 2]
    deltas, _ = stream(smol, chat_prompt(smol), ones(ids), SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == smol.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is (not skip)


def test_sentencepiece_first_token_keeps_space_from_prompt(sp: Tokenizer) -> None:
    prompt, out = sp.encode("The quick", add_special_tokens=False), sp.encode(
        "brown fox 😀 jumps", add_special_tokens=False)
    assert sp.decode(out) == "brown fox 😀 jumps"  # a bare decode drops the leading space
    for chunks in (ones(out), [out], split(out, random.Random(0))):
        deltas, _ = stream(sp, prompt, chunks)
        assert "".join(deltas) == " brown fox 😀 jumps"
        assert not any("\ufffd" in d for d in deltas)


@HYPO
@given(text=st.text(min_size=1, max_size=60), prompt=st.text(max_size=20),
       seed=st.integers(0, 2**32))
def test_property_byte_level_text(smol: Tokenizer, text: str, prompt: str, seed: int) -> None:
    ids = smol.encode(text)
    deltas, _ = stream(smol, smol.encode(prompt), split(ids, random.Random(seed)))
    assert "".join(deltas) == smol.decode(ids)


@HYPO
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=40), seed=st.integers(0, 2**32))
def test_property_byte_level_random_ids(smol: Tokenizer, ids: list[int], seed: int) -> None:
    """Arbitrary ids, including byte sequences that are not valid UTF-8 at all."""
    deltas, _ = stream(smol, [1, 2, 3], split(ids, random.Random(seed)))
    assert "".join(deltas) == smol.decode(ids)


@HYPO
@given(text=st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=40),
       seed=st.integers(0, 2**32))
def test_property_sentencepiece(sp: Tokenizer, text: str, seed: int) -> None:
    prompt, ids = sp.encode("Hello", add_special_tokens=False), sp.encode(
        text, add_special_tokens=False)
    deltas, _ = stream(sp, prompt, split(ids, random.Random(seed)))
    full, context = sp.decode(prompt + ids), sp.decode(prompt)
    assert "".join(deltas) == full[len(context):]


def test_window_stays_small_on_long_output(smol: Tokenizer) -> None:
    """Each step decodes a few tokens, not the output so far (1000 tokens here)."""
    ids = (smol.encode(" ".join(SAMPLES)) * 100)[:1000]
    seen: list[int] = []

    class Counting(Tokenizer):
        def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            seen.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    deltas, _ = stream(Counting(smol.hf), chat_prompt(smol), ones(ids))
    assert "".join(deltas) == smol.decode(ids)
    assert max(seen) <= 8 and len(seen) <= 2 * len(ids)


def test_garbage_bytes_do_not_grow_the_window(smol: Tokenizer) -> None:
    lead_byte = smol.hf.convert_tokens_to_ids("ð")  # 0xF0 alone: never a complete character
    detok = IncrementalDetokenizer(smol, [], SamplingParams())
    deltas, sizes = [], []
    for _ in range(3 * MAX_PENDING_TOKENS):
        deltas.append(detok.step([lead_byte])[0])
        sizes.append(len(detok._ids))
    deltas.append(detok.flush())
    assert max(sizes) <= 2 * MAX_PENDING_TOKENS + 4
    assert "".join(deltas) == "\ufffd" * 3 * MAX_PENDING_TOKENS


# --- stop strings ------------------------------------------------------------------------

def reference_stop(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """What a character-by-character stream would emit: cut at the first completed stop."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[:end - len(stop)]), stop
    return text, None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_and_steps(smol: Tokenizer, include: bool) -> None:
    text = "The answer is 42. Then more text follows here."
    ids = smol.encode(text)
    params = SamplingParams(stop=("42. Th",), include_stop_str_in_output=include)
    rng = random.Random(1)
    for chunks in [ones(ids), [ids], *(split(ids, rng) for _ in range(5))]:
        deltas, stop = stream(smol, [], chunks, params)
        assert stop == "42. Th"
        assert "".join(deltas) == ("The answer is 42. Th" if include else "The answer is ")


def test_partial_stop_is_held_then_released(smol: Tokenizer) -> None:
    params = SamplingParams(stop=("STOP!",))
    detok = IncrementalDetokenizer(smol, [], params)
    assert detok.step(smol.encode("go ST")) == ("go ", None)  # "ST" may start "STOP!"
    assert detok.step(smol.encode("OP")) == ("", None)
    assert detok.step(smol.encode(" no")) == ("STOP no", None)
    assert detok.step(smol.encode(" STO")) == (" ", None)
    assert detok.flush() == "STO"  # finished by length: the held text is not lost


def test_stop_inside_unfinished_character_step(smol: Tokenizer) -> None:
    ids = smol.encode("a 😀")  # the 2nd token is ' ' plus the emoji's first 3 bytes
    detok = IncrementalDetokenizer(smol, [], SamplingParams(stop=(" ",)))
    assert detok.step(ids[:1]) == ("a", None)
    assert detok.step(ids[1:2]) == ("", " ")


def test_first_completed_stop_wins(smol: Tokenizer) -> None:
    params = SamplingParams(stop=("abcd", "c", "bc"))
    deltas, stop = stream(smol, [], [smol.encode("xxabcd")], params)
    assert ("".join(deltas), stop) == ("xxa", "bc")


def test_stop_found_in_flushed_tail(smol: Tokenizer) -> None:
    ids = smol.encode("end 😀")[:-1]
    deltas, stop = stream(smol, [], [ids], SamplingParams(stop=("d ",)))
    assert ("".join(deltas), stop) == ("en", "d ")
    deltas, stop = stream(smol, [], [ids], SamplingParams(stop=("nd \ufffd",)))
    assert (deltas, stop) == (["e", ""], None)  # "nd" held as a possible stop, then cut


@HYPO
@given(text=st.text(alphabet="ab c😀", min_size=1, max_size=40),
       stops=st.lists(st.text(alphabet="ab c😀", min_size=1, max_size=4), min_size=1,
                      max_size=3),
       include=st.booleans(), seed=st.integers(0, 2**32))
def test_property_stop_strings(smol: Tokenizer, text: str, stops: list[str], include: bool,
                               seed: int) -> None:
    ids = smol.encode(text)
    params = SamplingParams(stop=tuple(stops), include_stop_str_in_output=include)
    deltas, stop = stream(smol, [], split(ids, random.Random(seed)), params)
    assert ("".join(deltas), stop) == reference_stop(text, stops, include)


def test_stop_strings_ignored_while_not_checked(smol: Tokenizer) -> None:
    """Before min_tokens (check_stops=False) a stop string neither stops nor is held back."""
    ids = smol.encode("one two one two", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, [], SamplingParams(stop=(" two",)))
    first, hit = detok.step(ids[:2], check_stops=False)  # "one two": passes through whole
    assert (first, hit) == ("one two", None)
    rest, hit = detok.step(ids[2:])
    assert (rest, hit) == (" one", " two")


@pytest.mark.parametrize("name", ["smol", "sp"])
def test_max_token_bytes_bounds_every_tokens_text(name: str,
                                                  request: pytest.FixtureRequest) -> None:
    """The prompt-size bound (EngineLimits.max_prompt_bytes) rests on this: no token's text
    is longer than max_token_bytes, so N tokens never cover more than N times it."""
    tok: Tokenizer = request.getfixturevalue(name)
    bound = tok.max_token_bytes()
    longest = max(len(tok.decode([i], skip_special_tokens=False).encode("utf-8", "replace"))
                  for i in range(tok.vocab_size))
    assert 0 < longest <= bound
