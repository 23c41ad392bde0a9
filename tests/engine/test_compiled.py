"""The compiled step (engine/worker/compile.py) against the eager one on the tiny models.

Each tiny model is compiled once (module-scoped runners below): the Llama with bucketed
token counts (max_num_batched_tokens 8: buckets 1, 2, 4, 8), the Qwen2 with the token count
dynamic (the default: graphs for T == 1 and T >= 2). Both runners get the same
sequences, block tables and steps, so their pools hold the same K/V; every step's logits
must agree within TOL (fp32: inductor fuses and reorders reductions, so bitwise equality is
not promised; observed differences are ~1e-6). The steps cover prefill, chunked prefill
(c > 0), decode-only, mixed, and steps padded to a bucket."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutput

from engine.config import EngineConfig
from engine.worker.compile import bucket_for, inductor_options, token_buckets
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput
from tests.engine.test_golden import TEXTS, make_engine, run
from tests.support.models import BlockAllocator, greedy_seq, loaded_runner, tiny_config

TOL = 1e-4  # absolute, on logits of magnitude ~10 (random tiny weights of std 0.2)
PROMPTS = [[5, 9, 13, 200, 17], [42, 43, 44, 60, 61, 62], list(range(100, 107))]
# (sequence index, tokens) per step; comments: packed T -> bucket
STEPS = [
    [(0, 5)],  # prefill, 5 -> 8: padded
    [(0, 1), (1, 3)],  # mixed: a decode and a first chunk, 4
    [(0, 1), (1, 3)],  # mixed, the chunk continues a cached prefix (c = 3), 4
    [(0, 1), (1, 1)],  # decode-only, 2
    [(0, 1), (2, 7)],  # mixed, 8
    [(0, 1), (1, 1), (2, 1)],  # decode-only, 3 -> 4: padded
    [(0, 1)],  # one decode, 1
    [(0, 1), (1, 1), (2, 1)],
]


def compiled_config(folder: Path, **engine: object) -> EngineConfig:
    cfg = tiny_config(folder, enforce_eager=False, **engine)
    return replace(cfg, scheduler=replace(cfg.scheduler, max_num_batched_tokens=8))


@pytest.fixture(scope="module")
def compiled_llama(tiny_llama: Path) -> ModelRunner:
    """Llama with bucketed token counts (4 graphs)."""
    return loaded_runner(compiled_config(tiny_llama, compile_dynamic=False))


@pytest.fixture(scope="module")
def compiled_qwen2(tiny_qwen2: Path) -> ModelRunner:
    """Qwen2 (q/k/v biases, tied embeddings) with the token count dynamic (the default)."""
    return loaded_runner(compiled_config(tiny_qwen2, compile_dynamic=True))


@torch.inference_mode()
def step_logits(runner: ModelRunner, batch: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
    step = runner._prepare(batch)
    logits = runner._forward(step.input_ids, step.position_ids, step.metadata, step.keep)
    assert step.sample_rows is not None or not step.sample_ids
    rows = logits if step.sample_rows is None else logits[step.sample_rows]
    return rows, step.sample_ids


def run_lockstep(eager: ModelRunner, compiled: ModelRunner) -> float:
    """Play STEPS on both runners; sample greedily from the eager logits. -> max |diff|."""
    seqs = [greedy_seq(f"s{i}", p, 16) for i, p in enumerate(PROMPTS)]
    alloc = BlockAllocator(min(eager.num_kv_blocks, compiled.num_kv_blocks))
    worst = 0.0
    for plan in STEPS:
        batch = SchedulerOutput()
        for i, n in plan:
            seq = seqs[i]
            alloc.cover(seq, seq.num_computed_tokens + n, eager.block_size)
            batch.seqs.append(seq)
            batch.num_scheduled_tokens.append(n)
        want, ids = step_logits(eager, batch)
        got, got_ids = step_logits(compiled, batch)
        assert ids == got_ids
        assert want.shape == got.shape
        worst = max(worst, (want - got).abs().max().item() if want.numel() else 0.0)
        tokens = dict(zip(ids, want.argmax(dim=-1).tolist(), strict=True))
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            seq.num_computed_tokens += n
            if seq.seq_id in tokens:
                seq.append_token(tokens[seq.seq_id])
    return worst


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_logits_match_eager(arch: str, request: pytest.FixtureRequest) -> None:
    eager: ModelRunner = request.getfixturevalue(f"{arch}_runner")
    compiled: ModelRunner = request.getfixturevalue(f"compiled_{arch}")
    assert eager.compiled is None and compiled.compiled is not None
    assert run_lockstep(eager, compiled) < TOL


def test_an_int8_pool_goes_through_the_compiled_step(compiled_llama: ModelRunner,
                                                    tiny_llama: Path) -> None:
    """--kv-cache-dtype int8 with the compiled step: the attention op is opaque to the graph
    and reads the pool from the step's metadata, so the same graphs serve an int8 pool (here
    put in place of the compiled runner's own) and give the eager int8 runner's logits. A
    K/V code on a rounding edge may round the other way when the float32 sums' last bits
    differ: a looser bound than TOL."""
    eager = loaded_runner(tiny_config(tiny_llama, kv_cache_dtype="int8"))
    assert eager.kv_cache.dtype == torch.int8
    own = compiled_llama.kv_cache
    compiled_llama.kv_cache = torch.zeros_like(eager.kv_cache)
    try:
        assert run_lockstep(eager, compiled_llama) < 2e-2  # measured 5e-6: no edge was hit
    finally:
        compiled_llama.kv_cache = own


def test_padding_rows_write_no_kv(compiled_llama: ModelRunner) -> None:
    """A 3-token step runs as the 4-token bucket: the pool changes only in the 3 real slots."""
    assert compiled_llama.compiled is not None
    assert compiled_llama.compiled.padded_size(3) == 4
    seq = greedy_seq("p", [7, 8, 9], 1)
    BlockAllocator(compiled_llama.num_kv_blocks, seed=3).cover(seq, 3, compiled_llama.block_size)
    batch = SchedulerOutput(seqs=[seq], num_scheduled_tokens=[3])
    pool = compiled_llama.kv_cache
    pool.fill_(float("nan"))  # untouched slots stay NaN
    step_logits(compiled_llama, batch)
    written = ~pool.isnan().all(dim=-1)  # [layers, 2, blocks, kvH, block_size]
    assert int(written.sum()) == 3 * pool.shape[0] * 2 * pool.shape[3]
    pool.zero_()


def test_no_graph_breaks(compiled_llama: ModelRunner) -> None:
    """The whole decoder is one graph: attention is the opaque op, not a break per layer."""
    from engine.attention.compile_op import forward_context
    from engine.attention.paged import build_metadata

    compiled = compiled_llama.compiled
    assert compiled is not None
    meta = build_metadata(None, 4, list(range(4)), [], [(0, 4, 0, [0])], torch.device("cpu"))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with forward_context(meta), torch.inference_mode():
        report = torch._dynamo.explain(compiled._body)(ids, torch.arange(4)[None])
    assert report.graph_break_count == 0, report.break_reasons
    assert report.graph_count == 1


def test_buckets() -> None:
    assert token_buckets(8) == [1, 2, 4, 8]
    assert token_buckets(1024) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512, 1024]
    assert token_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 100]
    assert [bucket_for([1, 2, 4, 8], n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, 9]


def test_the_cpu_wrapper_is_cpp_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled tests here run through these options: on the CPU the C++ wrapper, its
    entry built apart from the kernels; CUDA keeps inductor's defaults; a user's
    TORCHINDUCTOR_CPP_WRAPPER wins."""
    monkeypatch.delenv("TORCHINDUCTOR_CPP_WRAPPER", raising=False)
    assert inductor_options(torch.device("cpu")) == {"cpp_wrapper": True,
                                                     "cpp_wrapper_build_separate": True}
    assert inductor_options(torch.device("cuda")) == {}
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "0")
    assert inductor_options(torch.device("cpu")) == {}


class ToyDecoder(torch.nn.Module):
    """A decoder with a plain Python constant: dynamo bakes it into the graph. With `breaks`,
    its forward has a graph break (a print), so dynamo compiles that forward as a frame of its
    own, whose code every ToyDecoder shares."""

    def __init__(self, scale: float, breaks: bool) -> None:
        super().__init__()
        self.scale = scale
        self.breaks = breaks
        self.embed = torch.nn.Embedding(16, 4)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                use_cache: bool) -> BaseModelOutput:
        hidden = self.embed(input_ids) * self.scale
        if self.breaks:
            print(end="")
        return BaseModelOutput(last_hidden_state=hidden + position_ids[..., None] * self.scale)


class Toy(torch.nn.Module):
    def __init__(self, scale: float, breaks: bool) -> None:
        super().__init__()
        self.decoder = ToyDecoder(scale, breaks)

    def get_decoder(self) -> torch.nn.Module:
        return self.decoder

    def get_output_embeddings(self) -> torch.nn.Module:
        return torch.nn.Identity()


@pytest.mark.parametrize("breaks", [False, True])
@torch.inference_mode()
def test_guard_filter_keeps_the_shape_choice_and_each_model_its_own_graphs(
        breaks: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's guards are dropped (keep_input_guards): the inputs' shapes still pick the
    graph (two buckets), and two compiled models never run each other's graph, which dynamo's
    cache per code object would do without a code object per CompiledForward (and, after a
    graph break, in the model's own forward, if that frame's guards were dropped too)."""
    from engine.attention.paged import build_metadata
    from engine.worker.compile import CompiledForward, keep_input_guards

    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "0")  # the Python wrapper: a faster compile
    kept: list[tuple[int, int]] = []

    def recording(entries: list) -> list[bool]:  # type: ignore[type-arg]
        flags = keep_input_guards(entries)
        kept.append((sum(flags), len(flags)))
        return flags

    monkeypatch.setattr("engine.worker.compile.keep_input_guards", recording)
    models = [Toy(2.0, breaks), Toy(3.0, breaks)]
    compiled = [CompiledForward(m, 2) for m in models]  # buckets 1 and 2
    for size in (1, 2, 1):
        ids, pos = torch.arange(size)[None], torch.arange(size)[None]
        meta = build_metadata(None, size, list(range(size)), [], [(0, size, 0, [0])],
                              torch.device("cpu"))
        for model, fwd in zip(models, compiled, strict=True):
            want = model.decoder(ids, pos, False).last_hidden_state
            assert torch.equal(fwd.hidden(ids, pos, meta), want)
    filtered = [k for k, total in kept if k < total]  # frames of _body: the model's guards went
    assert len(filtered) == 4  # one graph per model and size, no recompile
    assert all(k >= 2 for k in filtered)  # the two inputs' tensor guards stayed
    # with the break, the forward up to it and the rest of it are two more frames, all guards kept
    assert len(kept) == (12 if breaks else 4)


def test_op_outside_forward_context_is_an_error() -> None:
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="forward_context"):
        torch.ops.pagedserve.paged_attention(q, q[:, :1], q[:, :1], 0, 0.5)


def test_enforce_eager_and_batch_invariant_do_not_compile(tiny_llama: Path) -> None:
    assert loaded_runner(tiny_config(tiny_llama, enforce_eager=True)).compiled is None
    runner = loaded_runner(tiny_config(tiny_llama, enforce_eager=False, batch_invariant=True))
    assert runner.compiled is None


# ----------------------------------------------------------------------------- SmolLM2 (slow)


@pytest.fixture(scope="module")
def compiled_smollm2() -> ModelRunner:
    """The real SmolLM2, fp32, dense (as the golden runner), compiled as the server compiles it."""
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512,
                            block_size=16)
    return loaded_runner(EngineConfig(model=None, dtype="float32", device="cpu",
                                      num_kv_blocks=256, quantization="none", scheduler=sched))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


@pytest.mark.slow
@pytest.mark.heavy  # ~2.5 min of inductor compile on 2 cores: `pytest -m heavy` runs it
def test_compiled_greedy_equals_eager_on_golden_prompts(
        smollm2_runner: ModelRunner, compiled_smollm2: ModelRunner) -> None:
    """All golden prompts at once through the engine: prefill chunks, mixed and decode steps."""
    assert smollm2_runner.compiled is None and compiled_smollm2.compiled is not None
    tok = smollm2_runner.tokenizer
    prompts = {f"p{i}": tok.encode(t) for i, t in enumerate(TEXTS)}
    eager = run(make_engine(smollm2_runner), prompts)
    compiled = run(make_engine(compiled_smollm2), prompts)
    diverged = {rid: first_divergence(eager[rid], compiled[rid]) for rid in prompts}
    assert all(d is None for d in diverged.values()), diverged
