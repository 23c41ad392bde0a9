"""A GGUF file's model config as transformers (5.25) reads it, corrected where its reader
loses what the file says (found by tests/engine/test_gguf_families.py, docs/models.md):

- Some keys are not read, and the config class's default stands in: a default sized for one
  real checkpoint (Qwen3's head_dim 128, Qwen3-MoE's moe_intermediate_size 768), so a file of
  any other shape fails to load, or loads wrong; Gemma 2's soft caps, so a file with others
  loads as another model. They are put back from the file.
- Gemma 2's and 3's query scale is not in the file: llama.cpp derives it (1/sqrt(head_dim),
  1/sqrt(hidden / heads) for the 27B models), transformers takes query_pre_attn_scalar's default
  (256: right where head_dim is 256, wrong for both 27B models). It is set as llama.cpp has it.
- A Llama-architecture file named "mistral" (how llama.cpp writes Mistral) becomes a
  MistralConfig, whose tensors transformers then cannot name ("Unknown gguf model_type:
  mistral in gguf-py": gguf-py has no "mistral" architecture). It is loaded as Llama, which
  is what llama.cpp runs it as: the same modules, and no sliding window, which a Llama file
  cannot carry.
- gpt-oss is refused by name: transformers lists it, but its reader fails on the rope.scaling
  metadata every llama.cpp gpt-oss file has, and maps neither the experts nor the attention
  sinks (it would leave them random). Checked by tests/engine/test_gguf_families.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# architecture -> {metadata key under `{arch}.`: config attribute} the reader leaves out.
LEFT_OUT: dict[str, dict[str, str]] = {
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
}
# architecture -> the depth of its 27B model, whose queries llama.cpp scales by hidden / heads
# (llama-model.cpp, f_attention_scale); every other depth by head_dim.
QUERY_SCALE_DEPTH = {"gemma2": 46, "gemma3": 62}
# architecture -> why transformers (5.25) cannot read its files, though it lists it.
UNREADABLE = {
    "gpt-oss": "transformers' GGUF reader fails on its rope.scaling metadata (it reads a "
               "key's length as the value) and maps neither its experts (ffn_*_exps, biases "
               "included) nor its attention sinks, which it would leave random",
}


def gguf_config(gguf: Path) -> Any:
    """The config to load `gguf` with (pass it to from_pretrained with the gguf_file)."""
    from transformers import AutoConfig
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(gguf))  # arrays left as counts: ~ms
    arch = metadata["general.architecture"]
    if arch in UNREADABLE:
        raise ValueError(f"GGUF files of architecture {arch} are not read: {UNREADABLE[arch]}")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for key, attr in LEFT_OUT.get(arch, {}).items():
        if (value := metadata.get(f"{arch}.{key}")) is not None:
            setattr(config, attr, value)
    if arch in QUERY_SCALE_DEPTH:
        config.query_pre_attn_scalar = query_scalar(config, QUERY_SCALE_DEPTH[arch])
    if arch == "llama" and config.model_type == "mistral":
        return as_llama(config)
    return config


def query_scalar(config: Any, depth_27b: int) -> int:
    if config.num_hidden_layers == depth_27b:
        return int(config.hidden_size // config.num_attention_heads)
    return int(config.head_dim)


def as_llama(config: Any) -> Any:
    from transformers import LlamaConfig

    fields = config.to_dict()
    for key in ("model_type", "sliding_window", "architectures", "transformers_version"):
        fields.pop(key, None)
    return LlamaConfig(**fields)
