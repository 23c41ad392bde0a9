"""A GGUF file's model config as transformers (5.25) reads it, corrected where its reader
loses what the file says (found by tests/engine/test_gguf_families.py, docs/models.md):

- Some keys are not read, and the config class's default stands in: a default sized for one
  real checkpoint (Qwen3's head_dim 128, Qwen3-MoE's moe_intermediate_size 768), so a file of
  any other shape fails to load, or loads wrong. They are put back from the file.
- A Llama-architecture file named "mistral" (how llama.cpp writes Mistral) becomes a
  MistralConfig, whose tensors transformers then cannot name ("Unknown gguf model_type:
  mistral in gguf-py": gguf-py has no "mistral" architecture). It is loaded as Llama, which
  is what llama.cpp runs it as: the same modules, and no sliding window, which a Llama file
  cannot carry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# architecture -> {metadata key under `{arch}.`: config attribute} the reader leaves out.
LEFT_OUT: dict[str, dict[str, str]] = {
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
}


def gguf_config(gguf: Path) -> Any:
    """The config to load `gguf` with (pass it to from_pretrained with the gguf_file)."""
    from transformers import AutoConfig
    from transformers.integrations.gguf import read_gguf_metadata

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    metadata, _ = read_gguf_metadata(str(gguf))  # arrays left as counts: ~ms
    arch = metadata["general.architecture"]
    for key, attr in LEFT_OUT.get(arch, {}).items():
        if (value := metadata.get(f"{arch}.{key}")) is not None:
            setattr(config, attr, value)
    if arch == "llama" and config.model_type == "mistral":
        return as_llama(config)
    return config


def as_llama(config: Any) -> Any:
    from transformers import LlamaConfig

    fields = config.to_dict()
    for key in ("model_type", "sliding_window", "architectures", "transformers_version"):
        fields.pop(key, None)
    return LlamaConfig(**fields)
