"""Write a Hugging Face checkpoint as a GGUF file laid out the way llama.cpp's converter lays
it out, so tests and benchmarks can load GGUFs of families and sizes nobody ships: the tiny
random checkpoint of each family (tests/engine/test_gguf_families.py), a 1B Llama in
F16 / Q8_0 / Q4_0.

What a reader needs, and transformers' GGUF reader (transformers/integrations/ggml.py,
modeling_gguf_pytorch_utils.py) reads back:
- the hyperparameters under `{arch}.*` keys (which of them transformers reads differs per
  architecture; we write what llama.cpp writes and let the reader pick);
- the tokenizer as metadata: `tokenizer.ggml.model` "gpt2" (byte-level BPE, the only kind
  written here) with tokens, merges, token types and the special ids;
- the tensors under gguf's own names (`gguf.get_tensor_name_map`), with llama.cpp's layout
  changes that the reader undoes: q/k rows in the interleaved rotary order for the Llama
  architecture, Gemma's RMSNorm weights stored as 1 + w, MoE experts as one gate, one up
  and one down tensor per layer (gpt-oss's de-interleaved and transposed, biases too).

A family whose config says something its llama.cpp architecture cannot (a sliding window
on the Llama architecture, say) is refused, rather than written as a different model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.gguf_archs import (
    ARCHS,
    GgufArch,
    head_dim,
    refuse_inexpressible,
    rope,
    rope_type,
)

QUANT_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
EXPERT_ROUTER = "ffn_gate_inp"  # kept in F32, as llama-quantize does: a rounded router picks other experts


def export_gguf(checkpoint: Path, out: Path, qtype: str = "F32") -> Path:
    """Write `checkpoint` (a folder: config.json, safetensors, a fast tokenizer) to `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # dtype "auto": a bf16 checkpoint stays bf16 in memory; each tensor is widened on its own.
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto")
    return export_model(model, AutoTokenizer.from_pretrained(checkpoint), out, qtype)


def export_model(model: Any, tokenizer: Any, out: Path, qtype: str = "F32") -> Path:
    """Write a loaded causal LM and its tokenizer to `out`, its 2-D and 3-D weights in `qtype`
    (QUANT_TYPES), norms, biases and the MoE router in F32."""
    import gguf

    if qtype not in QUANT_TYPES:
        raise ValueError(f"qtype must be one of {', '.join(QUANT_TYPES)}, not {qtype!r}")
    config = model.config.get_text_config()
    arch = ARCHS.get(config.model_type)
    if arch is None:
        raise ValueError(f"no GGUF layout for model type {config.model_type!r}")
    refuse_inexpressible(config, arch)
    writer = gguf.GGUFWriter(str(out), arch.name)
    write_hparams(writer, config, arch, qtype)
    write_tokenizer(writer, tokenizer, config.vocab_size)
    for name, data in gguf_tensors(model, arch):
        add_tensor(writer, name, data, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# ----------------------------------------------------------------------------- metadata


def write_hparams(writer: Any, config: Any, arch: GgufArch, qtype: str) -> None:
    import gguf

    writer.add_name(arch.model_name or config.model_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32"
                         else gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None)
                             or config.num_attention_heads)
    # The Llama reader takes head_dim from the rotary width; Qwen3-MoE and Gemma 3's from key_length.
    dims = head_dim(config)
    writer.add_key_length(dims)
    writer.add_value_length(dims)
    writer.add_rope_dimension_count(int(dims * rope(config).get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(float(rope(config).get("rope_theta", 10000.0)))
    write_norm_eps(writer, config)
    writer.add_vocab_size(config.vocab_size)
    if experts := getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(getattr(config, "moe_intermediate_size", None)
                                              or config.intermediate_size)  # gpt-oss: the same
    if arch.windows and getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if arch.soft_caps:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if rope_type(config) == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope(config)["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope(config)["original_max_position_embeddings"]))


def write_norm_eps(writer: Any, config: Any) -> None:
    """RMSNorm families name theirs rms_norm_eps; LayerNorm ones norm_epsilon or layer_norm_eps."""
    if (eps := getattr(config, "rms_norm_eps", None)) is not None:
        writer.add_layer_norm_rms_eps(eps)
    for key in ("norm_epsilon", "layer_norm_eps", "layer_norm_epsilon"):
        if (eps := getattr(config, key, None)) is not None:
            writer.add_layer_norm_eps(eps)
            return


def write_tokenizer(writer: Any, tokenizer: Any, vocab_size: int) -> None:
    """A byte-level BPE as llama.cpp's "gpt2" model: ids beyond the tokenizer's own, up to the
    embedding's rows, become unused [PAD<i>] tokens (so the reader sizes the vocab right)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE" or "ByteLevel" not in json.dumps(spec["pre_tokenizer"]):
        raise NotImplementedError("only byte-level BPE tokenizers are written as GGUF")
    tokens, types = vocabulary(spec, vocab_size)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for token, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                       ("pad", writer.add_pad_token_id), ("unk", writer.add_unk_token_id)):
        if (token_id := getattr(tokenizer, f"{token}_token_id", None)) is not None:
            add(token_id)
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def vocabulary(spec: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens by id and their llama.cpp types: added special tokens CONTROL, other added ones
    USER_DEFINED, holes and padding UNUSED."""
    from gguf import TokenType

    size = max(vocab_size, len(spec["model"]["vocab"]), *(a["id"] + 1 for a in spec["added_tokens"]))
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [int(TokenType.UNUSED)] * size
    for token, token_id in spec["model"]["vocab"].items():
        tokens[token_id], types[token_id] = token, int(TokenType.NORMAL)
    for added in spec["added_tokens"]:
        kind = TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED
        tokens[added["id"]], types[added["id"]] = added["content"], int(kind)
    return tokens, types


def pre_tokenizer_name(spec: dict[str, Any]) -> str:
    """llama.cpp's name for the tokenizer's split regex, as transformers' reader knows them
    (GGUF_PRE_TOKENIZER_SPLITS); "gpt-2" (the reader keeps GPT-2's own split) otherwise."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    text = json.dumps(spec["pre_tokenizer"])
    for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        if json.dumps(regex)[1:-1] in text:
            return name
    return "gpt-2"


# ----------------------------------------------------------------------------- tensors


def gguf_tensors(model: Any, arch: GgufArch) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in PyTorch's row-major shape) for every tensor to write."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    config = model.config.get_text_config()
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch.name)
    names = get_tensor_name_map(arch_id, config.num_hidden_layers)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # no output.weight: the reader ties the head to token_embd
        data = tensor.float().numpy()
        if ".mlp.experts." in hf_name:  # stacked [experts, ...]: weights, gpt-oss's biases
            yield from expert_tensors(names, hf_name, data, arch)
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name} in {arch.name}")
        yield (name if name.endswith((".weight", ".bias")) else f"{name}.weight",
               laid_out(name, data, arch, config))


def expert_tensors(names: Any, hf_name: str, data: np.ndarray,
                   arch: GgufArch) -> Iterator[tuple[str, np.ndarray]]:
    """One layer's stacked experts as ffn_{gate,up,down}_exps, [experts, out, in] each (and
    [experts, out] biases). Qwen3-MoE keeps gate_up as [E, 2I, H], gate rows first; gpt-oss as
    [E, H, 2I] with gate and up columns interleaved, down as [E, I, H] (llama.cpp's converter
    transposes both and de-interleaves, its biases too)."""
    stem, _, part = hf_name.rpartition(".")
    bias = part.endswith("_bias")
    proj = part.removesuffix("_bias")
    suffix = ".bias" if bias else ".weight"
    if arch.interleaved_experts and not bias:
        data = data.swapaxes(-1, -2)
    if proj == "down_proj":
        yield f"{names.get_name(f'{stem}.down_proj')}{suffix}", np.ascontiguousarray(data)
        return
    if proj != "gate_up_proj":
        raise ValueError(f"no GGUF name for {hf_name} in {arch.name}")
    if arch.interleaved_experts:  # rows (or bias entries) g0, u0, g1, u1, ...
        gate, up = data[:, 0::2], data[:, 1::2]
    else:
        gate, up = np.split(data, 2, axis=1)
    yield f"{names.get_name(f'{stem}.gate_proj')}{suffix}", np.ascontiguousarray(gate)
    yield f"{names.get_name(f'{stem}.up_proj')}{suffix}", np.ascontiguousarray(up)


def laid_out(name: str, data: np.ndarray, arch: GgufArch, config: Any) -> np.ndarray:
    """llama.cpp's layout changes, each undone by transformers' tensor processor."""
    if arch.rotary_rows and (".attn_q." in name or ".attn_k." in name):
        heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
        return interleave_rotary_rows(data, heads)
    if arch.norm_offset and name.endswith("norm.weight"):
        return data + np.float32(arch.norm_offset)
    return data


def interleave_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Per head, HF rotates (x[i], x[i + d/2]) pairs and llama.cpp (x[2i], x[2i + 1]): rows
    [first half, second half] become [h0, s0, h1, s1, ...]. w: [heads * d, ...] (a bias too)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tensor(writer: Any, name: str, data: np.ndarray, qtype: str) -> None:
    """1-D tensors (norms, biases) and the router stay F32; a weight whose rows do not split
    into whole blocks too (llama.cpp falls back the same way)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, _ = gguf.GGML_QUANT_SIZES[kind]
    if data.ndim < 2 or EXPERT_ROUTER in name or data.shape[-1] % block:
        kind = gguf.GGMLQuantizationType.F32
    if kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
