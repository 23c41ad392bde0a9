"""The family matrix of issue 33 (docs/models.md): a tiny random checkpoint of each family,
loaded through the real loader, gives HF generate()'s greedy tokens in float32, token for
token, under chunked prefill, a prefix-cache hit and preemption; its compiled step matches
eager (two families in the default run, the rest with -m heavy); its int8/int4 and fused
paths match their own reference math and generate. GGUF: test_gguf_families.py.

Sliding windows (8 tokens, against prompts of 13-42): Mistral on every layer (its blocks out
of the window are released), Qwen2 on its second layer, Gemma 2/3 and gpt-oss on their local
layers; Gemma 2 with soft caps and gpt-oss with sinks that change the greedy tokens. GPT-2
(it failed at its first step) is refused before it loads: tested below.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention import cpu_kernels
from engine.worker.loader import load_model
from engine.worker.model_runner import ModelRunner
from scheduler.sampling_params import SamplingParams
from tests.engine.test_golden import assert_all_free, hf_greedy, make_engine, run
from tests.support.models import build_checkpoint, loaded_runner, tiny_config

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "granite", "olmo2", "smollm3", "qwen3_moe", "phi", "gemma",
            "olmo", "cohere", "starcoder2", "glm", "mistral_window", "qwen2_window",
            "gemma3_text", "gemma2", "gpt_oss"]
NEW = 12


def hf_model(folder: Path) -> torch.nn.Module:
    """transformers' own model, none of our load-time rewrites (MoE experts run HF's loop)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, ModelRunner]:
    folder = build_checkpoint(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)
    return request.param, folder, loaded_runner(tiny_config(folder))


def test_family_matches_hf_generate_token_for_token(
        family: tuple[str, Path, ModelRunner]) -> None:
    arch, folder, runner = family
    if arch.endswith("_window") or arch.startswith("gemma3_text"):  # not clamped to the window
        assert runner.windows and runner.max_model_len == 256
        # the C++ decode kernel takes the window, where it builds
        assert runner.paged_decode_kernel == cpu_kernels.paged_decode_available()
    hf = hf_model(folder)
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, runner.vocab_size, (12,), generator=gen).tolist()  # 3 blocks
    prompts = {f"{arch}{i}": shared + torch.randint(3, runner.vocab_size, (int(n),),
                                                    generator=gen).tolist()
               for i, n in enumerate(torch.randint(1, 30, (6,), generator=gen))}
    want = {rid: hf_greedy(hf, ids, NEW) for rid, ids in prompts.items()}
    params = SamplingParams(temperature=0.0, max_tokens=NEW)  # stops at EOS, as generate()
    first, *rest = prompts
    later = {0: [first], 3: rest}  # the others arrive once the shared prefix is cached
    for sched in ({"max_num_batched_tokens": 256},  # prefix-cache hits
                  {"max_num_batched_tokens": 8},  # chunked prefill
                  {"max_num_batched_tokens": 16, "num_kv_blocks": 14}):  # preemption
        engine = make_engine(runner, **sched)  # type: ignore[arg-type]
        arrivals = None if "num_kv_blocks" in sched else later
        assert run(engine, prompts, params, arrivals) == want, (arch, sched)
        stats = engine.stats()
        if "num_kv_blocks" in sched:
            assert stats.num_preemptions > 0
        else:
            assert stats.prefix_cache_hits > 0
        assert_all_free(engine)


def test_an_all_sliding_model_holds_only_its_window(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Mistral with a window of 8 on every layer, blocks of 4: a sequence at 4x the window
    holds the window's blocks (plus the one being filled and the parent kept for the prefix
    cache), not its whole context; its tokens are still HF generate()'s."""
    folder = build_checkpoint(tmp_path_factory.mktemp("tiny-mistral-held"), "mistral_window")
    runner = loaded_runner(tiny_config(folder))
    engine = make_engine(runner, max_num_batched_tokens=256)
    assert engine.limits.sliding_window == 8
    prompt = torch.randint(3, runner.vocab_size, (32,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=NEW))
    seq = engine.scheduler.get("long")
    assert seq is not None
    got: list[int] = []
    most = 0
    while engine.has_unfinished():
        for o in engine.step():
            got.extend(o.new_token_ids)
        if not seq.is_finished:
            most = max(most, sum(1 for b in seq.block_table if b >= 0))
            assert len(seq.block_table) >= 8  # its context: 32+ tokens, 8+ blocks
    assert most <= 8 // 4 + 2
    hf = hf_model(folder)
    assert got == hf_greedy(hf, prompt, NEW)
    assert_all_free(engine)


# Compiled in the default run: a window on every layer, and Gemma 2's local + global layers
# with its soft caps. Each other family compiles in ~8 s here: `pytest -m heavy` runs them.
COMPILED_BY_DEFAULT = {"mistral_window", "gemma2"}
COMPILED_ELSEWHERE = {"llama", "qwen2"}  # tests/engine/test_compiled.py, in the default run


@pytest.mark.parametrize("arch", [
    pytest.param(a, marks=() if a in COMPILED_BY_DEFAULT else pytest.mark.heavy)
    for a in FAMILIES if a not in COMPILED_ELSEWHERE])
def test_the_compiled_step_matches_eager(arch: str,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """The compiled step (dynamic token count: the default) against eager, step by step in
    lockstep on the same block tables: prefill, chunked prefill, decode-only and mixed steps
    (tests/engine/test_compiled.py's plan); sequence 0 outgrows an 8-token window."""
    from tests.engine.test_compiled import TOL, compiled_config, run_lockstep

    folder = build_checkpoint(tmp_path_factory.mktemp(f"tiny-compiled-{arch}"), arch)
    eager = loaded_runner(tiny_config(folder))
    compiled = loaded_runner(compiled_config(folder, compile_dynamic=True))
    assert compiled.compiled is not None and compiled.windows == eager.windows
    assert run_lockstep(eager, compiled) < TOL


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300,
                               n_positions=64)).save_pretrained(folder)
    return folder


def test_an_unsupported_family_is_refused_before_it_loads(tiny_gpt2: Path) -> None:
    """issue 33: GPT-2 loaded, then failed at its first step (and LLM.generate returned empty
    text). Now the loader refuses it at once, naming it and what is served."""
    from engine.worker.families import SUPPORTED_FAMILIES, UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="^model type 'gpt2' is not supported: "
                       "pagedserve serves cohere, gemma, ") as e:
        load_model(str(tiny_gpt2), device="cpu", dtype="float32")
    assert all(f in str(e.value) for f in SUPPORTED_FAMILIES)


def test_the_cli_refuses_an_unsupported_or_missing_model_in_one_line(
        tiny_gpt2: Path, tmp_path: Path) -> None:
    from api.cli import main

    with pytest.raises(SystemExit, match=r"^pagedserve: error: model type 'gpt2' is not "):
        main(["serve", "--config", "tiny", "--model", str(tiny_gpt2)])
    with pytest.raises(SystemExit, match=r"^pagedserve: error: model not found: "):
        main(["serve", "--config", "tiny", "--model", str(tmp_path / "nope")])


def test_the_family_is_read_from_config_json_or_the_gguf_metadata(tiny_gpt2: Path) -> None:
    from engine.worker.families import model_type_of
    from engine.worker.loader import embedded_gguf

    assert model_type_of(tiny_gpt2) == "gpt2"
    assert model_type_of(embedded_gguf()) == "llama"  # the embedded SmolLM2's Q4_1 file


@pytest.mark.parametrize("arch", ["granite", "cohere", "gemma3_text", "llama"])
def test_the_compiled_steps_head_applies_the_familys_logit_transform(
        arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The compiled step applies the LM head itself; Granite's logits_scaling, Cohere's
    logit_scale and Gemma's final soft cap are the CausalLM forward's last step, so it
    applies them too (logit_transform), or its logits differ from eager's."""
    import transformers

    from engine.worker.families import logit_transform

    folder = build_checkpoint(tmp_path_factory.mktemp(f"tiny-head-{arch}"), arch)
    config = transformers.AutoConfig.from_pretrained(folder)
    if arch == "gemma3_text":
        config.final_logit_softcapping = 3.0  # Gemma 2's is 30; 3 bites on tiny logits
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config).eval()
    ids = torch.tensor([[5, 9, 13, 20, 17]])
    with torch.inference_mode():
        want = model(ids).logits[0]
        head = model.get_output_embeddings()(model.get_decoder()(ids).last_hidden_state[0])
    transform = logit_transform(config)
    assert (transform is None) == (arch == "llama")
    got = head if transform is None else transform(head)
    torch.testing.assert_close(got, want)
    assert arch == "llama" or not torch.allclose(head, want)


QUANT_FAMILIES = [a for a in FAMILIES if not a.endswith("_window")]


@pytest.mark.parametrize("arch", QUANT_FAMILIES)
def test_quantized_and_fused_paths_load_and_generate(
        arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """--quantization int8 and int4 on each family, with the sibling projections fused (the
    loader fuses quantized models): the logits equal their own reference math (the same
    family's HF model with its linears quantized alone, unfused) and stay near the dense
    model's; bf16 dense with fused and packed linears; then the engine generates (int8)."""
    import transformers

    from engine.layers.fused_linears import ProjectionSlice
    from engine.layers.moe import use_grouped_experts
    from engine.layers.quantization.linear import Int4Linear, Int8Linear
    from engine.layers.quantization.quant import quantize_model

    folder = build_checkpoint(tmp_path_factory.mktemp(f"tiny-quant-{arch}"), arch)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])  # 6 rows: the kernels, not the dense copies
    for mode, bound in (("int8", 0.06), ("int4", 0.4)):  # measured on llama: 0.039, 0.288
        ours = load_model(str(folder), device="cpu", dtype="float32", quantization=mode).model
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.inference_mode():
            dense = ref(input_ids=ids).logits
            use_grouped_experts(ref)  # MoE experts as linears, which quantize_model replaces
            quantize_model(ref, mode, None, dense_above=None)
            want, got = ref(input_ids=ids).logits, ours(input_ids=ids).logits
        quantized = [n for n, m in ours.named_modules() if isinstance(m, (Int4Linear, Int8Linear))]
        # Each of the 2 layers: its attention's projections (q/k/v fused or not, and the
        # output) and its MLP's; gpt-oss's experts stay dense (not grouped: docs/models.md).
        assert sum(".self_attn." in n for n in quantized) >= 2 * 2, (arch, mode)
        assert sum(".mlp." in n for n in quantized) >= 2 or arch == "gpt_oss", (arch, mode)
        # Phi-3's checkpoint fuses qkv and gate_up itself; int4 parts fuse only where they
        # line up with its 64-row blocks (Phi's and Starcoder2's 32-row k/v, no gate/up: apart).
        if arch != "phi3" and mode == "int8":
            assert any(isinstance(m, ProjectionSlice) for m in ours.modules()), arch
        assert (got - want).norm() / want.norm() < 1e-3, (arch, mode)
        assert (got - dense).norm() / dense.norm() < bound, (arch, mode)
    check_bf16_packed(arch, folder, ids)
    runner = loaded_runner(tiny_config(folder, quantization="int8"))
    engine = make_engine(runner, max_num_batched_tokens=64)
    out = run(engine, {"q": ids[0].tolist()}, SamplingParams(temperature=0.0, max_tokens=8,
                                                             ignore_eos=True))
    assert len(out["q"]) == 8


def check_bf16_packed(arch: str, folder: Path, ids: torch.Tensor) -> None:
    """bfloat16, dense: the loader fuses the sibling projections and, where oneDNN has bf16
    (packing_applies), packs every linear once; the logits stay within bf16's rounding of
    transformers' own bf16 model."""
    import transformers

    from engine.layers.fused_linears import ProjectionSlice
    from engine.layers.packed_linear import PackedLinear, packing_applies

    ours = load_model(str(folder), device="cpu", dtype="bfloat16", quantization="none").model
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    modules = list(ours.modules())
    if packing_applies(torch.device("cpu"), torch.bfloat16, False):
        assert sum(isinstance(m, PackedLinear) for m in modules) >= 2 * 2
    assert any(isinstance(m, ProjectionSlice) for m in modules) or arch == "phi3"
    with torch.inference_mode():
        want, got = ref(input_ids=ids).logits.float(), ours(input_ids=ids).logits.float()
    assert (got - want).norm() / want.norm() < 0.03, arch
