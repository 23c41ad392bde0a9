"""What llama.cpp's GGUF architectures can say, per transformers family: the table that
tests/support/gguf_export.py writes by, and the configs it refuses because their architecture
cannot state them (written anyway, the file would be read as another model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GgufArch:
    """How llama.cpp writes one transformers family."""

    name: str  # general.architecture
    rotary_rows: bool = False  # q/k rows permuted to llama.cpp's interleaved rotary pairs
    norm_offset: float = 0.0  # RMSNorm weights stored as offset + w (Gemma scales by 1 + w)
    model_name: str | None = None  # general.name; None: the model_type
    windows: bool = False  # the architecture carries `attention.sliding_window`
    global_every: int = 0  # a global layer every n-th, the rest sliding (fixed in llama.cpp)
    normalized_topk: bool = False  # the MoE routing weights always renormalized over the top k
    embedding_head: bool = False  # no output tensor: the token embedding is always the head
    soft_caps: bool = False  # Gemma 2's attention and final logit soft caps, as metadata
    query_scale_depth: int = 0  # queries scaled by 1/sqrt(head_dim); by hidden/heads at this depth
    yarn: bool = False  # YaRN RoPE scaling under rope.scaling.* (unscaled RoPE otherwise)
    interleaved_experts: bool = False  # gpt-oss: gate_up [E, H, 2I] interleaved, down [E, I, H]
    fixed: tuple[tuple[str, Any], ...] = ()  # (config attribute, the value llama.cpp hard-codes)


# model_type -> its llama.cpp architecture. Read back by transformers 5.25 (GGUF_CONFIG_MAPPING):
# llama, mistral, qwen2, qwen3, qwen3_moe, phi3, starcoder2, gemma3_text, gemma2 (some with the
# loader's fixes, engine/worker/gguf_config.py). gpt_oss is listed there but not read: the
# loader refuses it (tests/engine/test_gguf_families.py pins why). The rest are written
# with their architecture name and the layout above only, never read back: transformers refuses
# them ("GGUF model with architecture ... is not supported yet"), and llama.cpp's extra
# transforms for them (Granite's scales, OLMo 2's norms, ...) are not reproduced here.
ARCHS: dict[str, GgufArch] = {
    "llama": GgufArch("llama", rotary_rows=True),
    # llama.cpp writes Mistral as the Llama architecture; transformers tells them apart by a
    # general.name of exactly "mistral".
    "mistral": GgufArch("llama", rotary_rows=True, model_name="mistral"),
    "qwen2": GgufArch("qwen2"),
    "qwen3": GgufArch("qwen3"),
    "qwen3_moe": GgufArch("qwen3moe", normalized_topk=True),
    "phi3": GgufArch("phi3"),
    "starcoder2": GgufArch("starcoder2"),
    # Gemma 2 and 3: llama.cpp scales queries by 1/sqrt(head_dim), except at the 27B models'
    # depth (46 and 62 layers), where by 1/sqrt(hidden / heads); query_pre_attn_scalar is not
    # in the file. Gemma 2 has no output tensor (llama.cpp's converter drops lm_head).
    "gemma3_text": GgufArch("gemma3", norm_offset=1.0, windows=True, global_every=6,
                            query_scale_depth=62),
    "gemma2": GgufArch("gemma2", norm_offset=1.0, windows=True, global_every=2,
                       embedding_head=True, soft_caps=True, query_scale_depth=46),
    # llama.cpp's OPENAI_MOE: a global layer every 2nd, YaRN, experts from a dense checkpoint
    # (MXFP4 ones are repacked as they are; not written here).
    "gpt_oss": GgufArch("gpt-oss", windows=True, global_every=2, yarn=True,
                        interleaved_experts=True,
                        fixed=(("swiglu_alpha", 1.702), ("swiglu_limit", 7.0))),
    "phi": GgufArch("phi2"),
    "gemma": GgufArch("gemma", norm_offset=1.0),
    "granite": GgufArch("granite"),
    "olmo": GgufArch("olmo"),
    "olmo2": GgufArch("olmo2"),
    "smollm3": GgufArch("smollm3"),
    "cohere": GgufArch("command-r"),
    "glm": GgufArch("chatglm"),  # llama.cpp registers GlmForCausalLM under ChatGLM
}


def refuse_inexpressible(config: Any, arch: GgufArch) -> None:
    """ValueError naming what the config says that `arch` cannot: written anyway, the file
    would be read as another model."""
    said = [*inexpressible_attention(config, arch), *inexpressible_rope(config, arch),
            *inexpressible_fixed(config, arch)]
    if said:
        raise ValueError(f"cannot write {config.model_type} as GGUF: it has " + "; ".join(said))


def inexpressible_attention(config: Any, arch: GgufArch) -> list[str]:
    said = []
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False and not arch.windows:
        said.append(f"a sliding window ({window}), which the {arch.name} architecture has not")
    if arch.global_every and config.layer_types != pattern(config, arch.global_every):
        said.append(f"layer types {config.layer_types}, where {arch.name} has a global layer "
                    f"every {arch.global_every}th and the rest sliding")
    if arch.soft_caps:
        said += [f"no {cap}, where {arch.name} always caps" for cap in
                 ("attn_logit_softcapping", "final_logit_softcapping") if getattr(config, cap) is None]
    if arch.query_scale_depth and config.query_pre_attn_scalar != query_scalar(config, arch):
        said.append(f"query_pre_attn_scalar {config.query_pre_attn_scalar}, where {arch.name} "
                    f"scales queries by {query_scalar(config, arch)} at {config.num_hidden_layers} "
                    "layers")
    return said


def inexpressible_fixed(config: Any, arch: GgufArch) -> list[str]:
    said = [f"{key} {getattr(config, key)}, where {arch.name} has {value}"
            for key, value in arch.fixed if getattr(config, key) != value]
    if arch.normalized_topk and not config.norm_topk_prob:
        said.append(f"norm_topk_prob False, where {arch.name} always renormalizes the top k")
    if arch.embedding_head and not getattr(config, "tie_word_embeddings", False):
        said.append(f"an LM head of its own, where {arch.name} has none (the token embedding "
                    "is the head)")
    return said


def inexpressible_rope(config: Any, arch: GgufArch) -> list[str]:
    kind = rope_type(config)
    if kind == "default":
        return []
    if kind != "yarn" or not arch.yarn:
        return [f"rope type {kind!r} (only unscaled RoPE is written here, and YaRN for gpt-oss)"]
    said, params = [], rope(config)
    if params.get("truncate", True) is False:  # ggml_rope_yarn_corr_dims: floor and ceil, always
        said.append("YaRN without truncating its correction range (truncate False), where "
                    "llama.cpp always truncates it")
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):  # ggml's defaults
        if params.get(key, default) != default:
            said.append(f"YaRN {key} {params[key]} (written: factor and original context only)")
    if params.get("attention_factor") is not None:
        said.append("a YaRN attention_factor (written: factor and original context only)")
    return said


def query_scalar(config: Any, arch: GgufArch) -> int:
    """What llama.cpp scales Gemma 2's / 3's queries by (1/sqrt of it): head_dim, or hidden /
    heads at the 27B models' depth (llama-model.cpp, `f_attention_scale`)."""
    if config.num_hidden_layers == arch.query_scale_depth:
        return int(config.hidden_size // config.num_attention_heads)
    return int(head_dim(config))


def pattern(config: Any, every: int) -> list[str]:
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(config.num_hidden_layers)]


def rope(config: Any) -> dict[str, Any]:
    """The global layers' RoPE parameters (Gemma 3 keeps one set per layer type)."""
    params: dict[str, Any] = getattr(config, "rope_parameters", None) or {}
    return params.get("full_attention", params)


def rope_type(config: Any) -> str:
    return str(rope(config).get("rope_type", "default"))


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
