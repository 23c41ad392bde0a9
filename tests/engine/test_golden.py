"""The correctness contract, end to end through LLMEngine: with temperature 0 our tokens equal
Hugging Face generate() greedy tokens, token for token, whatever else is in the batch, after
preemption, chunked prefill or a prefix-cache hit. Every scenario ends with all blocks free."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.outputs import TokenLogprobs
from engine.worker.loader import load_model
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.step_budget import StepBudget
from scheduler.step_cost import CostModel, StepShape

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "Water boils at",
    "The three primary colors are red,",
    "In 1969, the first humans to walk on the Moon were Neil Armstrong and",
    "Translate to French: 'Good morning, how are you today?' ->",
    "A haiku about autumn leaves:\n",
    "The quick brown fox",
    "Q: What is 12 times 12?\nA:",
    ("Machine learning is a field of computer science that gives computers the ability to learn "
     "without being explicitly programmed. It is closely related to statistics and"),
]
SHARED_PREFIX = (
    "You are a careful assistant. Answer briefly and precisely, in one sentence, without any "
    "preamble. Think about the user's question before answering it, and never invent facts. "
    "If the question is ambiguous, say what you assume. Question: "
)
SECOND_ROUND = ["What is the tallest mountain?", "Why is the sky blue?", "Who wrote Hamlet?",
                "What is the boiling point of water?"]


def make_engine(runner: ModelRunner, num_kv_blocks: int | None = None, **sched: object) -> LLMEngine:
    cfg = EngineConfig(model=None, dtype="float32", device="cpu", enforce_eager=True, num_kv_blocks=num_kv_blocks,
                       scheduler=SchedulerConfig(block_size=runner.block_size, **sched))  # type: ignore[arg-type]
    engine = LLMEngine(cfg, runner=runner)
    engine.load()
    return engine


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY,
        arrivals: dict[int, list[str]] | None = None) -> dict[str, list[int]]:
    """Drive the engine to completion; `arrivals` maps step number -> ids added then."""
    pending = dict(prompts)
    schedule = arrivals or {0: list(prompts)}
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    step = 0
    while pending or engine.has_unfinished():
        for rid in schedule.get(step, []):
            engine.add_request(rid, pending.pop(rid), params)
        if not engine.has_unfinished() and pending:
            step = min(k for k in schedule if k > step)
            continue
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    assert_all_free(engine)
    return out


def assert_all_free(engine: LLMEngine) -> None:
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def hf_greedy(model: torch.nn.Module, ids: list[int], max_new: int) -> list[int]:
    inp = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=max_new,
            top_p=None, top_k=None, temperature=None)
    return out[0, len(ids):].tolist()


# ----------------------------------------------------------------------------- SmolLM2 (exact)


@pytest.fixture(scope="module")
def smol_prompts(smollm2_runner: ModelRunner) -> dict[str, list[int]]:
    tok = smollm2_runner.tokenizer
    return {f"p{i}": tok.encode(t) for i, t in enumerate(TEXTS)}


@pytest.fixture(scope="module")
def smol_hf() -> torch.nn.Module:
    """HF's own model of the embedded SmolLM2, float32."""
    return load_model(None, device="cpu", dtype="float32").model


@pytest.fixture(scope="module")
def smol_reference(smol_hf: torch.nn.Module) -> Callable[[dict[str, list[int]]], dict]:
    hf = smol_hf
    cache: dict[tuple[int, ...], list[int]] = {}

    def reference(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
        for ids in prompts.values():
            if tuple(ids) not in cache:
                cache[tuple(ids)] = hf_greedy(hf, ids, MAX_NEW)
        return {rid: cache[tuple(ids)] for rid, ids in prompts.items()}

    return reference


@pytest.mark.slow
def test_all_at_once(smollm2_runner, smol_prompts, smol_reference) -> None:
    engine = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=1024)
    assert run(engine, smol_prompts) == smol_reference(smol_prompts)


@pytest.mark.slow
def test_arrivals_while_others_decode(smollm2_runner, smol_prompts, smol_reference) -> None:
    # While others decode, at most 8 prompt tokens per step: arrivals' prompts are cut into
    # chunks, and a running prompt waits out steps where an earlier one used the 8 tokens.
    engine = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=256,
                         decode_step_prefill_tokens=8)
    ids = list(smol_prompts)
    arrivals = {0: ids[:3], 3: ids[3:6], 7: ids[6:9], 12: ids[9:]}
    assert run(engine, smol_prompts, arrivals=arrivals) == smol_reference(smol_prompts)


@pytest.mark.slow
def test_arrivals_under_the_step_time_budget(smollm2_runner, smol_prompts, smol_reference) -> None:
    """--target-itl-ms: a fitted cost model sizes the prompt chunks that join decoding steps
    (here a fixed one that leaves room for a few prompt tokens a step, so every arrival is
    cut into small chunks of varying length); the engine feeds it every step's shape and time."""
    engine = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=256,
                         target_itl_ms=20.0, prefill_stretch=1.0)
    calibrated = engine.scheduler.step_budget
    assert calibrated is not None and calibrated.model is not None  # fitted at load
    # The start-up fit replaced by a known one (a fresh budget fed the truth's step times):
    engine.scheduler.step_budget = budget = StepBudget(0.020, 1.0, floor=16)
    truth = CostModel(fixed=0.010, per_decode=0.001, per_prefill=0.001, per_prefill_seq=0.001)
    for d, p, s in itertools.product((0, 1, 3, 6), (0, 5, 20, 60), (1, 2)):
        if d or p:
            shape = StepShape(d, p, 0, 0.0, s if p else 0)
            budget.observe(shape, truth.step_time(shape))
    assert budget.model is not None
    seen: list[tuple[StepShape, float]] = []
    budget.observe = lambda shape, seconds: seen.append((shape, seconds))  # type: ignore[method-assign]
    chunks: list[int] = []
    schedule = engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = schedule()
        decoding = any(n == 1 for n in out.num_scheduled_tokens)
        chunks.extend(n for n in out.num_scheduled_tokens if n > 1 and decoding)
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    ids = list(smol_prompts)
    arrivals = {0: ids[:3], 3: ids[3:6], 7: ids[6:9], 12: ids[9:]}
    assert run(engine, smol_prompts, arrivals=arrivals) == smol_reference(smol_prompts)
    assert chunks and max(chunks) <= 10 and len(set(chunks)) > 1, chunks
    assert len(seen) == engine.num_steps and all(t > 0 for _, t in seen)


@pytest.mark.slow
def test_preemption(smollm2_runner, smol_prompts, smol_reference) -> None:
    # 12 prompts of 5-40 tokens + 24 new tokens need ~40 blocks of 16; give the pool 10.
    engine = make_engine(smollm2_runner, num_kv_blocks=10, max_num_seqs=16,
                         max_num_batched_tokens=512)
    assert run(engine, smol_prompts) == smol_reference(smol_prompts)
    assert engine.stats().num_preemptions > 0


@pytest.mark.slow
def test_chunked_prefill(smollm2_runner, smol_prompts, smol_reference) -> None:
    engine = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=16,
                         long_prefill_token_threshold=7)
    assert max(len(p) for p in smol_prompts.values()) > 7 * 3  # some prompt takes >= 4 chunks
    assert run(engine, smol_prompts) == smol_reference(smol_prompts)


@pytest.mark.slow
def test_prefix_cache_hits(smollm2_runner, smol_reference) -> None:
    tok = smollm2_runner.tokenizer
    first = {f"a{i}": tok.encode(SHARED_PREFIX + q) for i, q in enumerate(SECOND_ROUND[:2])}
    second = {f"b{i}": tok.encode(SHARED_PREFIX + q) for i, q in enumerate(SECOND_ROUND)}
    engine = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=512)
    assert run(engine, first) == smol_reference(first)
    hits_before = engine.stats().prefix_cache_hits
    assert run(engine, second) == smol_reference(second)
    prefix_blocks = len(tok.encode(SHARED_PREFIX)) // smollm2_runner.block_size
    assert engine.stats().prefix_cache_hits - hits_before >= len(second) * prefix_blocks * 16 - 16


# Speculative decoding (n-gram prompt lookup): the drafts the model keeps, then its own token,
# give HF's greedy tokens token for token, in a full batch, after preemption (a draft's
# blocks are freed with its sequence), with prompts chunked around drafting rows.
SPECULATIVE = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
               '"disable_by_batch_size": 0}')


@pytest.mark.slow
@pytest.mark.parametrize("case", ["all_at_once", "preemption", "chunked_arrivals"])
def test_speculative_decoding_matches_hf(case: str, smollm2_runner, smol_prompts,
                                         smol_reference) -> None:
    sched: dict[str, object] = {"max_num_seqs": 16, "max_num_batched_tokens": 1024,
                                "speculative_config": SPECULATIVE}
    arrivals = None
    if case == "preemption":
        sched |= {"num_kv_blocks": 10, "max_num_batched_tokens": 512}
    elif case == "chunked_arrivals":
        sched |= {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 7,
                  "decode_step_prefill_tokens": 8}
        ids = list(smol_prompts)
        arrivals = {0: ids[:3], 3: ids[3:6], 7: ids[6:9], 12: ids[9:]}
    engine = make_engine(smollm2_runner, **sched)  # type: ignore[arg-type]
    assert run(engine, smol_prompts, arrivals=arrivals) == smol_reference(smol_prompts)
    stats = engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # kept and rejected
    assert case != "preemption" or stats.num_preemptions > 0


@pytest.mark.slow
def test_suffix_decoding_matches_hf_and_drafts_from_earlier_answers(
        smollm2_runner, smol_prompts, smol_reference) -> None:
    """The suffix method: the same prompts twice; the second time the cache holds the first
    answers, so more drafts are kept, and both times the tokens are HF's."""
    engine = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=1024,
                         speculative_config='{"method": "suffix", "num_speculative_tokens": 8, '
                                            '"disable_by_batch_size": 0}')
    kept = []
    for _ in range(2):
        before = engine.stats().spec_num_accepted_tokens
        assert run(engine, smol_prompts) == smol_reference(smol_prompts)
        kept.append(engine.stats().spec_num_accepted_tokens - before)
    assert 0 < kept[0] < kept[1], kept


def _run_collecting(engine: LLMEngine, prompts: dict[str, list[int]],
                    params: dict[str, SamplingParams]) -> tuple[dict[str, list[int]],
                                                                 dict[str, list[TokenLogprobs]]]:
    """Every request's tokens and the logprob entries its deltas carried, in order."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params[rid])
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    logprobs: dict[str, list[TokenLogprobs]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            logprobs[o.request_id].extend(o.logprobs or ())
    assert_all_free(engine)
    return tokens, logprobs


@pytest.mark.slow
def test_speculating_rows_share_steps_with_rows_that_cannot(smollm2_runner, smol_prompts,
                                                            smol_reference) -> None:
    """Requests with min_tokens (drafting only in runs that end short of it) and requests
    that report logprobs speculate beside plain ones: every request gets HF's tokens, and
    each kept token's logprobs are the ones decoding without drafts reports for it."""
    kinds = [GREEDY, replace(GREEDY, logprobs=2), replace(GREEDY, min_tokens=3)]
    params = {rid: kinds[i % 3] for i, rid in enumerate(smol_prompts)}
    engine = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=1024,
                         speculative_config=SPECULATIVE)
    tokens, logprobs = _run_collecting(engine, smol_prompts, params)
    assert tokens == smol_reference(smol_prompts)
    assert engine.stats().spec_num_accepted_tokens > 0
    # Only the logprobs requests again, alone, so that the drafts kept are theirs.
    asking = {rid: ids for rid, ids in smol_prompts.items() if params[rid].logprobs is not None}
    alone = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=1024,
                        speculative_config=SPECULATIVE)
    _, drafted = _run_collecting(alone, asking, params)
    assert alone.stats().spec_num_accepted_tokens > 0
    plain = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=1024)
    _, expected = _run_collecting(plain, asking, params)
    for rid in smol_prompts:
        if rid not in asking:
            assert logprobs[rid] == [], rid
            continue
        for got in (logprobs[rid], drafted[rid]):
            assert [e.chosen.token_id for e in got] == tokens[rid], rid
            assert [e.rank for e in got] == [e.rank for e in expected[rid]], rid
            assert [[t.token_id for t in e.top] for e in got] == \
                [[t.token_id for t in e.top] for e in expected[rid]], rid
            for a, b in zip(got, expected[rid], strict=True):
                assert a.chosen.logprob == pytest.approx(b.chosen.logprob, abs=1e-4), rid
                assert [t.logprob for t in a.top] == \
                    pytest.approx([t.logprob for t in b.top], abs=1e-4), rid


# ----------------------------------------------------------------------------- tiny random models


def within_top2(model: torch.nn.Module, ids: list[int], ours: list[int]) -> None:
    """Where our greedy token differs from HF's, it must be HF's second choice (near-ties
    in random tiny models flip under different but equally valid float orderings)."""
    seq = list(ids)
    for t in ours:
        with torch.inference_mode():
            logits = model(torch.tensor([seq])).logits[0, -1]
        top2 = torch.topk(logits, 2).indices.tolist()
        assert t in top2, f"token {t} not in HF top-2 {top2} after {len(seq) - len(ids)} tokens"
        seq.append(t)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_models_match_hf(arch: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(f"tiny_{arch}")
    runner = request.getfixturevalue(f"{arch}_runner")
    hf = load_model(str(folder), device="cpu", dtype="float32").model
    gen = torch.Generator().manual_seed(0)
    prompts = {f"t{i}": torch.randint(3, runner.vocab_size, (int(n),), generator=gen).tolist()
               for i, n in enumerate(torch.randint(3, 40, (8,), generator=gen))}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for sched in ({"max_num_batched_tokens": 256}, {"max_num_batched_tokens": 8},
                  {"max_num_batched_tokens": 256, "num_kv_blocks": 20}):
        engine = make_engine(runner, **sched)  # type: ignore[arg-type]
        ours = run(engine, prompts, params)
        for rid, ids in prompts.items():
            assert len(ours[rid]) == 12
            within_top2(hf, ids, ours[rid])
        if "num_kv_blocks" in sched:
            assert engine.stats().num_preemptions > 0


def test_speculation_and_the_batch_invariant_mode_are_refused_together() -> None:
    """A verified row's queries run in a step whose rows the drafts decide: batch-invariant
    tokens could not be promised, so the pairing is refused by name."""
    with pytest.raises(ValueError, match="speculative_config cannot be combined with "
                                         "batch_invariant"):
        EngineConfig(batch_invariant=True, scheduler=SchedulerConfig(
            speculative_config=SPECULATIVE))


@pytest.mark.slow
def test_a_stop_string_cuts_a_verified_run_where_decoding_would_stop(
        smollm2_runner, smol_prompts) -> None:
    """A stop string that completes inside a verified run of drafts: the output (text, tokens,
    usage, stop reason) is the output without speculation, cut at the token that completed
    it. The stop strings are picked from a first speculative run: the first two tokens of a
    step that yielded three or more, where the string first occurs in the text."""
    tok = smollm2_runner.tokenizer

    def outputs(speculative: str | None, params: dict[str, SamplingParams]
                ) -> dict[str, list[tuple[tuple[int, ...], str, object, object, int]]]:
        engine = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=1024,
                             speculative_config=speculative)
        for rid, ids in smol_prompts.items():
            engine.add_request(rid, ids, params[rid])
        got: dict[str, list[tuple[tuple[int, ...], str, object, object, int]]] = {
            rid: [] for rid in smol_prompts}
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id].append((o.new_token_ids, o.new_text, o.finish_reason,
                                          o.stop_reason, o.num_output_tokens))
        assert_all_free(engine)
        return got

    runs = outputs(SPECULATIVE, dict.fromkeys(smol_prompts, GREEDY))
    stops: dict[str, SamplingParams] = {}
    for rid, deltas in runs.items():
        ids: list[int] = []
        text = ""
        for new_ids, new_text, *_ in deltas:
            stop = tok.decode(list(new_ids[:2]))
            full = "".join(d[1] for d in deltas)
            if len(new_ids) >= 3 and stop.strip() and full.find(stop) == len(text):
                stops[rid] = replace(GREEDY, stop=(stop,))
                break
            ids += new_ids
            text += new_text
    assert stops  # at least one run of three tokens or more, cut in its middle
    params = {rid: stops.get(rid, GREEDY) for rid in smol_prompts}

    def flat(got: dict[str, list[tuple[tuple[int, ...], str, object, object, int]]]
             ) -> dict[str, tuple[object, ...]]:
        return {rid: (sum((d[0] for d in ds), ()), "".join(d[1] for d in ds), *ds[-1][2:])
                for rid, ds in got.items()}

    plain = flat(outputs(None, params))
    assert all(plain[rid][3] == params[rid].stop[0] for rid in stops)  # each stops on its string
    assert flat(outputs(SPECULATIVE, params)) == plain


@pytest.mark.slow
def test_seeded_sampled_requests_draw_the_same_tokens_with_drafts(smollm2_runner,
                                                                 smol_prompts) -> None:
    """A drafted position is sampled with the uniform decoding would use there, and a draft is
    kept only if it is the token drawn: a seeded request gets the tokens it gets without
    speculation, whatever its truncation or bias (so, uniforms being independent, an
    unseeded one follows the same distribution). Up to float rounding: a step of other
    rows rounds the logits differently, as another batch does, which moves a draw that
    sits on a boundary of the CDF; of 36 requests x 24 draws here, one such draw differed
    on the 2-core box. A verifier that kept a draft the draw did not pick would change most
    of them."""
    kinds = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_NEW),
             SamplingParams(temperature=0.5, top_k=20, min_p=0.05, max_tokens=MAX_NEW),
             SamplingParams(temperature=1.0, logit_bias={13: 2.0}, max_tokens=MAX_NEW)]
    params = {f"{rid}-s{seed}": replace(kinds[(i + seed) % 3], seed=seed)
              for i, rid in enumerate(smol_prompts) for seed in range(3)}
    prompts = {key: smol_prompts[key.split("-")[0]] for key in params}

    def tokens(speculative: str | None) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=1024,
                             speculative_config=speculative)
        for key, ids in prompts.items():
            engine.add_request(key, ids, params[key])
        out: dict[str, list[int]] = {key: [] for key in prompts}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        assert_all_free(engine)
        return out, engine

    plain, _ = tokens(None)
    drafted, engine = tokens(SPECULATIVE)
    differ = [key for key in plain if drafted[key] != plain[key]]
    assert len(differ) <= 2, differ
    stats = engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


@pytest.mark.slow
def test_penalised_requests_speculate_and_keep_their_tokens(smollm2_runner,
                                                           smol_prompts) -> None:
    """Penalties with drafts: a drafting row counts the drafts before its position, so each
    token kept is the one decoding draws there. Greedy requests with repetition, presence and
    frequency penalties get the tokens they get without speculation, token for token, and
    drafts were kept for them."""
    kinds = [replace(GREEDY, repetition_penalty=1.3),
             replace(GREEDY, presence_penalty=0.8, frequency_penalty=0.4),
             replace(GREEDY, repetition_penalty=0.9, frequency_penalty=-0.3)]
    params = {rid: kinds[i % 3] for i, rid in enumerate(smol_prompts)}
    plain, _ = _run_collecting(make_engine(smollm2_runner, max_num_seqs=16,
                                           max_num_batched_tokens=1024), smol_prompts, params)
    engine = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=1024,
                         speculative_config=SPECULATIVE)
    builder = smollm2_runner.sampling
    real_build = builder.build
    counted: list[int] = []

    def build(seqs: list[Any], device: torch.device, masks: Any = None,
              offsets: list[int] | None = None, drafts: Any = None) -> Any:
        """The runner hands the step's drafts to the sampler: a penalised row at offset j
        counts its sequence's first j drafts (tests/engine/test_penalty_state.py)."""
        for seq, j in zip(seqs, offsets or [0] * len(seqs), strict=True):
            if j:
                assert len(drafts[seq.seq_id]) >= j
                counted.append(j)
        return real_build(seqs, device, masks, offsets, drafts)

    builder.build = build  # type: ignore[method-assign]
    try:
        drafted, _ = _run_collecting(engine, smol_prompts, params)
    finally:
        del builder.build  # the class's method again
    assert drafted == plain
    stats = engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert counted


@pytest.mark.slow
def test_min_tokens_with_stop_strings_is_decodings_with_drafts(smollm2_runner) -> None:
    """Before min_tokens a run of drafts ends short of the gate and the gate's token is
    decoded alone, so a stop string that occurs before the gate is passed over as it is
    without drafts. A repeated sentence makes the drafts right; min_tokens 1-9 puts the gate
    at each place in it (text, tokens and finish reasons equal)."""
    ids = smollm2_runner.tokenizer.encode(REPEATED)
    params = {f"m{n}": replace(GREEDY, min_tokens=n, stop=(".",), max_tokens=40)
              for n in range(1, 10)}

    def outputs(speculative: str | None) -> tuple[dict[str, tuple[object, ...]], int]:
        engine = make_engine(smollm2_runner, max_num_seqs=16, max_num_batched_tokens=1024,
                             speculative_config=speculative)
        for rid, p in params.items():
            engine.add_request(rid, ids, p)
        got: dict[str, list[Any]] = {rid: [(), "", None] for rid in params}
        while engine.has_unfinished():
            for o in engine.step():
                g = got[o.request_id]
                g[0] += o.new_token_ids
                g[1] += o.new_text
                g[2] = (o.finish_reason, o.stop_reason)
        assert_all_free(engine)
        return {rid: tuple(g) for rid, g in got.items()}, engine.stats().spec_num_accepted_tokens

    plain, _ = outputs(None)
    assert all(r[2] == ("stop", ".") for r in plain.values())
    assert len({r[1] for r in plain.values()}) > 1  # the gate passes over some "."
    drafted, kept = outputs(SPECULATIVE)
    assert drafted == plain and kept > 0


# Unseeded draws with drafts, against the model's own distribution. A repeated sentence makes
# the n-gram drafts often right; temperature 1.3 with top-k 3 gives every position three
# live candidates, so drafts are kept and rejected at each position.
REPEATED = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
DRAWS, TOP_K, TEMPERATURE, DRAWN_TOKENS = 300, 3, 1.3, 3


def _exact_joint(hf: torch.nn.Module, ids: list[int]) -> dict[tuple[int, ...], float]:
    """P(first DRAWN_TOKENS tokens) under temperature and top-k, from HF's forward."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(DRAWN_TOKENS):
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, p in joint.items():
            with torch.inference_mode():
                logits = hf(torch.tensor([ids + list(prefix)])).logits[0, -1].double()
            top = torch.topk(logits / TEMPERATURE, TOP_K)
            for t, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist(), strict=True):
                nxt[(*prefix, t)] = p * q
        joint = nxt
    return joint


def _chi_square_p(counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float],
                  n: int) -> float:
    """Pearson's test of counts against probabilities `expected` (outcomes expected fewer than
    5 times pooled into one bin, outcomes outside `expected` in it too) -> its p-value."""
    big = [k for k, p in expected.items() if p * n >= 5]
    observed = [counts.get(k, 0) for k in big]
    wanted = [expected[k] * n for k in big]
    observed.append(n - sum(observed))
    wanted.append(n - sum(wanted))
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted, strict=True) if e > 0)
    df = sum(1 for e in wanted if e > 0) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
def test_unseeded_draws_with_drafts_follow_the_models_distribution(smollm2_runner,
                                                                   smol_hf) -> None:
    """Chi-square over DRAWS unseeded requests: the joint of their first three tokens, with
    n-gram drafts verified, against the exact probabilities of HF's forward; the same counts
    must refute a sampler that draws the third token from the second position's distribution
    (what reusing a stale row would give), so the test can fail."""
    ids = smollm2_runner.tokenizer.encode(REPEATED)
    engine = make_engine(smollm2_runner, max_num_seqs=64, max_num_batched_tokens=1024,
                         speculative_config=SPECULATIVE)
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=DRAWN_TOKENS,
                            ignore_eos=True)
    out = run(engine, {f"d{i}": ids for i in range(DRAWS)}, params)
    stats = engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # kept and rejected
    counts: dict[tuple[int, ...], int] = {}
    for tokens in out.values():
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    hf = smol_hf
    exact = _exact_joint(hf, ids)
    assert _chi_square_p(counts, exact, DRAWS) > 1e-4
    stale = _stale_third_token(hf, ids, exact)
    assert _chi_square_p(counts, stale, DRAWS) < 1e-6


def _stale_third_token(hf: torch.nn.Module, ids: list[int],
                       exact: dict[tuple[int, ...], float]) -> dict[tuple[int, ...], float]:
    """A wrong joint: the third token drawn from the distribution the second was drawn from."""
    wrong: dict[tuple[int, ...], float] = {}
    pairs: dict[tuple[int, ...], float] = {}
    for k, p in exact.items():
        pairs[k[:2]] = pairs.get(k[:2], 0.0) + p
    for (a, b), p in pairs.items():
        with torch.inference_mode():
            logits = hf(torch.tensor([[*ids, a]])).logits[0, -1].double()
        top = torch.topk(logits / TEMPERATURE, TOP_K)
        for t, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist(), strict=True):
            wrong[(a, b, t)] = p * q
    return wrong
