"""StreamDetokenizer (tokenizers' DecodeStream) against IncrementalDetokenizer, its fallback and
the detokenizer before it: the same deltas, delta for delta (the same text and the same
boundaries between deltas), on SmolLM2's byte-level BPE, on SentencePiece-style byte-fallback
BPEs with and without Llama's leading-space strip, on multi-byte text (CJK, emoji sequences,
combining marks), on bytes that never make a character, with special tokens skipped or spelled
out, stop strings and the min_tokens gate; then through LLMEngine on a tiny random model
(whose tokens are mostly invalid UTF-8) and on SmolLM2's golden prompts."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core import llm_engine
from engine.core.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.stream_detokenizer import StreamDetokenizer, new_detokenizer
from engine.tokenizer import (
    MAX_PENDING_TOKENS,
    IncrementalDetokenizer,
    Tokenizer,
    _stop_prefix_len,
)
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from tests.engine.test_golden import MAX_NEW, TEXTS
from tests.engine.test_tokenizer import SAMPLES, split
from tests.support.sp_tokenizer import sentencepiece_tokenizer

HYPO = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
TOKENIZERS = ["smol", "sp", "sp_nostrip"]
MULTIBYTE = [
    "中文文本，日本語のテキスト、한국어 텍스트。",
    "Emoji 😀👍🏽 flags 🇫🇷🇯🇵 family 👩‍👩‍👧‍👦 keycap 1️⃣ end.",
    "Combining: e\u0301 a\u0300 n\u0303 Z\u0351\u0352\u0353 o\u0308\u0304 and ǅ ﬁ.",
    "Scripts ᚠᛇᚻ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 ∮ E⋅da = Q, Ελληνικά, עברית, العربية, हिन्दी.",
    "x中😀e\u0301中😀x" * 3,
]
Outcome = tuple[list[str], str | None]


@pytest.fixture(scope="session")
def sp() -> Tokenizer:
    """Llama 2's decoder: byte fallback, and the text's first space stripped."""
    return sentencepiece_tokenizer([s for s in SAMPLES if s.isascii()] * 10)


@pytest.fixture(scope="session")
def sp_nostrip() -> Tokenizer:
    """Gemma's decoder: byte fallback, the leading space kept."""
    return sentencepiece_tokenizer([s for s in SAMPLES if s.isascii()] * 10,
                                   strip_first_space=False)


def run(cls: type[IncrementalDetokenizer], tok: Tokenizer, prompt: Sequence[int],
        chunks: Sequence[Sequence[int]], params: SamplingParams, gate: int = 0) -> Outcome:
    """The engine's calls: step() per chunk (stop strings checked from chunk `gate` on, as
    min_tokens does), flush() unless a stop string ended it."""
    detok = cls(tok, prompt, params)
    deltas: list[str] = []
    for k, chunk in enumerate(chunks):
        text, stop = detok.step(chunk, check_stops=k >= gate)
        deltas.append(text)
        if stop is not None:
            assert detok.flush() == ""
            return deltas, stop
    deltas.append(detok.flush())
    return deltas, None


def same(tok: Tokenizer, prompt: Sequence[int], chunks: Sequence[Sequence[int]],
         params: SamplingParams | None = None, gate: int = 0) -> Outcome:
    """Both detokenizers' deltas, asserted equal one by one."""
    p = params or SamplingParams()
    new = run(StreamDetokenizer, tok, prompt, chunks, p, gate)
    old = run(IncrementalDetokenizer, tok, prompt, chunks, p, gate)
    assert new == old
    return new


def ones(ids: Sequence[int]) -> list[list[int]]:
    return [[i] for i in ids]


def chat_prompt(tok: Tokenizer) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say something."}]))


# --- which detokenizer -------------------------------------------------------------------

@pytest.mark.parametrize("name", TOKENIZERS)
def test_fast_tokenizers_stream(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    assert tok.backend is not None
    assert isinstance(new_detokenizer(tok, [1], SamplingParams()), StreamDetokenizer)
    # What the Rust decode skips: its added tokens marked special, at least transformers' own
    assert set(tok.hf.all_special_ids) <= tok.backend_special_ids


def test_a_tokenizer_whose_decode_is_not_the_rust_one_keeps_the_fallback(smol: Tokenizer
                                                                         ) -> None:
    class Custom(type(smol.hf)):  # type: ignore[misc]
        def _decode(self, token_ids: Any, **kwargs: Any) -> str:
            return str(super()._decode(token_ids, **kwargs)).upper()

    tok = Tokenizer(Custom(tokenizer_object=smol.hf.backend_tokenizer))
    assert tok.backend is None
    detok = new_detokenizer(tok, [1], SamplingParams())
    assert type(detok) is IncrementalDetokenizer
    assert detok.step(smol.encode("hi"))[0] == "HI"


def test_the_stream_path_decodes_nothing_in_python(smol: Tokenizer) -> None:
    """One DecodeStream step per token: after the context's one decode at the start, no
    decode through the window, even across multi-byte characters."""
    detok = StreamDetokenizer(smol, chat_prompt(smol), SamplingParams())
    calls: list[int] = []
    decode = detok._decode

    def counted(ids: list[int], skip: bool) -> str:
        calls.append(len(ids))
        return decode(ids, skip)

    detok._decode = counted
    ids = smol.encode(MULTIBYTE[0] + MULTIBYTE[1])
    text = "".join(detok.step([i])[0] for i in ids) + detok.flush()
    assert text == MULTIBYTE[0] + MULTIBYTE[1] and calls == []


# --- the same deltas ---------------------------------------------------------------------

@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text", MULTIBYTE + SAMPLES)
def test_multibyte_text_one_token_per_step(name: str, text: str,
                                           request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    prompt, ids = tok.encode("Answer:"), tok.encode(text, add_special_tokens=False)
    deltas, _ = same(tok, prompt, ones(ids))
    joined = "".join(deltas)
    assert joined.lstrip(" ") == text.lstrip(" ") and "\ufffd" not in joined
    rng = random.Random(text)
    for chunks in ([ids], *(split(ids, rng) for _ in range(3))):
        assert "".join(same(tok, prompt, chunks)[0]) == joined


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_spelled(name: str, skip: bool,
                                           request: pytest.FixtureRequest) -> None:
    """Special tokens inside the text, side by side and before a multi-byte character: the
    tokenizer's own spelling, nothing between two of them (spaces_between_special_tokens is
    refused unless true at the API, where it is inert), or nothing at all."""
    tok: Tokenizer = request.getfixturevalue(name)
    bos, eos = tok.hf.bos_token_id, tok.hf.eos_token_id
    one, two = tok.encode("One", False), tok.encode(" two 中😀", False)
    ids = [*one, bos, eos, eos, *two[:3], eos, *two[3:], eos]
    deltas, _ = same(tok, chat_prompt(tok) if tok.has_chat_template else [bos], ones(ids),
                     SamplingParams(skip_special_tokens=skip))
    spelled = tok.hf.convert_ids_to_tokens([bos, eos, eos])
    assert ("".join(spelled) in "".join(deltas)) is (not skip)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_long_run_of_skipped_special_tokens(name: str, request: pytest.FixtureRequest) -> None:
    """Past 20 of them the window's context is special tokens only; for Llama's decoder that
    context decodes to "" and the next leading space is stripped: the stream follows."""
    tok: Tokenizer = request.getfixturevalue(name)
    eos = tok.hf.eos_token_id
    ids = [eos] * 40 + tok.encode(" ok 中", add_special_tokens=False)
    for prompt in (tok.encode("Hello there", add_special_tokens=False), [eos]):
        same(tok, prompt, ones(ids))
        same(tok, prompt, ones(ids), SamplingParams(skip_special_tokens=False))


@pytest.mark.parametrize("name", TOKENIZERS)
def test_bytes_that_never_make_a_character(name: str, request: pytest.FixtureRequest) -> None:
    """A lead byte over and over: held up to MAX_PENDING_TOKENS, then let out as U+FFFD."""
    tok: Tokenizer = request.getfixturevalue(name)
    lead = tok.hf.convert_tokens_to_ids("ð" if name == "smol" else "<0xF0>")
    ids = [lead] * (3 * MAX_PENDING_TOKENS) + tok.encode(" fine 中", add_special_tokens=False)
    deltas, _ = same(tok, [1], ones(ids))
    assert "\ufffd" * MAX_PENDING_TOKENS in "".join(deltas)
    same(tok, [1], ones(ids), SamplingParams(stop=("fi",)))


@pytest.mark.parametrize("name", TOKENIZERS)
def test_prompt_ending_inside_a_character(name: str, request: pytest.FixtureRequest) -> None:
    """A context whose text ends in U+FFFD (a token-id prompt cut inside a character):
    DecodeStream would emit the context again; the window is kept until the context moves."""
    tok: Tokenizer = request.getfixturevalue(name)
    prompt = tok.encode("x😀", add_special_tokens=False)[:-1]
    deltas, _ = same(tok, prompt, ones(tok.encode("ab 中文 cd", add_special_tokens=False)))
    assert "x" not in "".join(deltas)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_stops_and_the_min_tokens_gate(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    text = "go 中文 ST😀OP! more 中文 and STOP! again"
    ids = tok.encode(text, add_special_tokens=False)
    for stops in (("STOP!",), ("中",), ("文 ", "😀"), (" ",), ("n\ufffd",)):
        for include in (False, True):
            params = SamplingParams(stop=stops, include_stop_str_in_output=include)
            for gate in (0, 3, 8):
                same(tok, [1], ones(ids), params, gate)
                same(tok, [1], split(ids, random.Random(gate)), params, gate)


@HYPO
@given(text=st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=40),
       prompt=st.text(max_size=12), seed=st.integers(0, 2**32), one_by_one=st.booleans(),
       skip=st.booleans())
@pytest.mark.parametrize("name", TOKENIZERS)
def test_property_text(name: str, text: str, prompt: str, seed: int, one_by_one: bool,
                       skip: bool, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    ids = tok.encode(text, add_special_tokens=False)
    chunks = ones(ids) if one_by_one else split(ids, random.Random(seed))
    same(tok, tok.encode(prompt), chunks, SamplingParams(skip_special_tokens=skip))


@HYPO
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=40),
       prompt=st.lists(st.integers(0, 49151), min_size=1, max_size=6),
       seed=st.integers(0, 2**32), one_by_one=st.booleans(), skip=st.booleans())
@pytest.mark.parametrize("name", TOKENIZERS)
def test_property_random_ids(name: str, ids: list[int], prompt: list[int], seed: int,
                             one_by_one: bool, skip: bool,
                             request: pytest.FixtureRequest) -> None:
    """Any ids: special tokens, byte pieces that are not UTF-8, prompts cut anywhere."""
    tok: Tokenizer = request.getfixturevalue(name)
    ids, prompt = [i % tok.vocab_size for i in ids], [i % tok.vocab_size for i in prompt]
    chunks = ones(ids) if one_by_one else split(ids, random.Random(seed))
    same(tok, prompt, chunks, SamplingParams(skip_special_tokens=skip))


@HYPO
@given(text=st.text(alphabet="ab c😀中\u0301", min_size=1, max_size=40),
       stops=st.lists(st.text(alphabet="ab c😀中\u0301", min_size=1, max_size=4), min_size=1,
                      max_size=3),
       include=st.booleans(), gate=st.integers(0, 6), seed=st.integers(0, 2**32),
       one_by_one=st.booleans())
@pytest.mark.parametrize("name", TOKENIZERS)
def test_property_stop_strings(name: str, text: str, stops: list[str], include: bool,
                               gate: int, seed: int, one_by_one: bool,
                               request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    ids = tok.encode(text, add_special_tokens=False)
    chunks = ones(ids) if one_by_one else split(ids, random.Random(seed))
    params = SamplingParams(stop=tuple(stops), include_stop_str_in_output=include)
    same(tok, [1], chunks, params, gate)


# --- through the engine ------------------------------------------------------------------

def engine_texts(runner: ModelRunner, prompts: list[list[int]],
                 params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    """Every request's deltas from one LLMEngine run (all requests at once)."""
    sched = SchedulerConfig(block_size=runner.block_size, max_num_seqs=16,
                            max_num_batched_tokens=1024)
    engine = LLMEngine(EngineConfig(model=None, dtype="float32", device="cpu",
                                    enforce_eager=True, scheduler=sched), runner=runner)
    engine.load()
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", ids, p)
    outs: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def engine_same(runner: ModelRunner, prompts: list[list[int]], params: list[SamplingParams],
                monkeypatch: pytest.MonkeyPatch) -> dict[str, list[RequestOutput]]:
    """The engine's deltas with the stream, then with the fallback: equal, delta for delta."""
    new = engine_texts(runner, prompts, params)
    tok = Tokenizer(runner.tokenizer)
    assert all(isinstance(new_detokenizer(tok, [1], p), StreamDetokenizer) for p in params)
    monkeypatch.setattr(llm_engine, "new_detokenizer", IncrementalDetokenizer)
    old = engine_texts(runner, prompts, params)
    assert {r: [(o.new_token_ids, o.new_text) for o in outs] for r, outs in new.items()} == {
        r: [(o.new_token_ids, o.new_text) for o in outs] for r, outs in old.items()}
    return new


def test_engine_deltas_on_a_random_model(llama_runner: ModelRunner,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Llama samples its ~320 byte-level tokens at random: mostly bytes that make no
    character, special tokens among them; stop strings, min_tokens and both skip settings."""
    tok = Tokenizer(llama_runner.tokenizer)
    prompts = [tok.encode(t) for t in ("The quick brown", "Hello", "0123 + 45", "Paged")] * 4
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, ignore_eos=i % 2 == 0,
                             skip_special_tokens=i % 3 != 0, min_tokens=(i % 4) * 3,
                             stop=(("o", "\ufffd\ufffd") if i % 5 == 0 else ()))
              for i in range(len(prompts))]
    outs = engine_same(llama_runner, prompts, params, monkeypatch)
    text = "".join(o.new_text for r in outs.values() for o in r)
    assert "\ufffd" in text and len(text) > 100  # the garbage paths ran


def replay(tok: Tokenizer, prompt: list[int], params: SamplingParams,
           outs: list[RequestOutput]) -> list[str]:
    """The fallback's deltas for the engine's steps, called as LLMEngine calls it: a stop
    token is not text, stop strings count from min_tokens output tokens on, flush at the end."""
    detok = IncrementalDetokenizer(tok, prompt, params)
    texts, produced = [], 0
    for o in outs:
        ids = list(o.new_token_ids)
        produced += len(ids)
        by_token = o.finish_reason == "stop" and not isinstance(o.stop_reason, str)
        if by_token and ids and not params.include_stop_str_in_output:
            ids = ids[:-1]
        text, stop = detok.step(ids, produced >= params.min_tokens)
        texts.append(text + (detok.flush() if o.finished and stop is None else ""))
    return texts


@pytest.mark.slow
def test_engine_deltas_on_the_golden_prompts(smollm2_runner: ModelRunner) -> None:
    """SmolLM2, greedy, on the golden prompts and a few that answer in other scripts; its
    tokens do not depend on the detokenizer, so one run is replayed through the fallback."""
    tok = Tokenizer(smollm2_runner.tokenizer)
    others = ["Translate to Chinese: 'good morning' ->", "Write three emoji for joy:",
              "Le café était très", "日本の首都は"]
    prompts = [tok.encode(t) for t in [*TEXTS, *others]]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW)] * len(prompts)
    params[0] = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=(" of",))
    params[1] = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, skip_special_tokens=False,
                               ignore_eos=True)
    params[2] = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=("\n", "(n"),
                               min_tokens=4)
    outs = engine_texts(smollm2_runner, prompts, params)
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        assert [o.new_text for o in outs[f"r{i}"]] == replay(tok, ids, p, outs[f"r{i}"])
    texts = ["".join(o.new_text for o in outs[f"r{i}"]) for i in range(len(prompts))]
    assert all(texts) and any(not t.isascii() for t in texts[len(TEXTS):])


def test_the_replay_is_the_engine(llama_runner: ModelRunner,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """replay() calls the fallback as LLMEngine does: on the fallback engine it gives back the
    engine's own deltas (stop strings, stop tokens, min_tokens)."""
    monkeypatch.setattr(llm_engine, "new_detokenizer", IncrementalDetokenizer)
    tok = Tokenizer(llama_runner.tokenizer)
    prompts = [tok.encode(t) for t in ("The quick brown", "Hello", "0123 + 45")] * 2
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=32, min_tokens=i,
                             stop=("e", "o") if i % 2 else (), stop_token_ids=(40 + i,))
              for i in range(len(prompts))]
    outs = engine_texts(llama_runner, prompts, params)
    assert any(o.finished and o.stop_reason is not None for r in outs.values() for o in r)
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        assert [o.new_text for o in outs[f"r{i}"]] == replay(tok, ids, p, outs[f"r{i}"])


def naive_stop_prefix_len(text: str, stops: Sequence[str], max_len: int) -> int:
    """The hold-back rule as it was written before: every tail, longest first."""
    for k in range(min(max_len - 1, len(text)), 0, -1):
        if any(stop.startswith(text[-k:]) for stop in stops):
            return k
    return 0


@HYPO
@given(text=st.text(alphabet="abc😀", max_size=12),
       stops=st.lists(st.text(alphabet="abc😀", min_size=1, max_size=6), min_size=1,
                      max_size=4))
def test_stop_prefix_len_is_the_naive_rule(text: str, stops: list[str]) -> None:
    max_len = max(len(s) for s in stops)
    assert _stop_prefix_len(text, stops, max_len) == naive_stop_prefix_len(text, stops, max_len)
