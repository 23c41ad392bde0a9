"""Which model families pagedserve serves: those a test shows give HF generate()'s greedy
tokens through our paged attention (tests/engine/test_golden.py, test_model_runner.py,
test_families.py; docs/models.md). Any other `model_type` is refused before it loads, with
one line naming it, instead of failing at its first step (GPT-2) or at load (StableLM).

Read from the checkpoint's config.json, or from a GGUF file's `general.architecture`, which
costs no model load. Also here: which layers of a family slide, and over how many tokens
(layer_windows), read from the loaded config.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where a model is loaded: the CLI's family check runs without it
    import torch

SUPPORTED_FAMILIES = frozenset({
    "llama", "qwen2", "qwen3", "mistral", "phi3", "phi", "gemma", "granite", "olmo", "olmo2",
    "smollm3", "qwen3_moe", "cohere", "starcoder2", "glm", "gemma3_text", "gemma2",
    "gpt_oss"})
# GGUF architecture names that differ from transformers' model_type.
GGUF_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "command-r": "cohere", "phi2": "phi",
                      "gemma3": "gemma3_text", "gpt-oss": "gpt_oss"}


class UnsupportedModelError(ValueError):
    pass


def model_type_of(source: Path) -> str | None:
    """The family of a checkpoint folder or a .gguf file (None: it does not say)."""
    if source.is_file():
        from gguf import GGUFReader  # memory-maps the file; only the metadata is read

        field = GGUFReader(source).fields.get("general.architecture")
        if field is None:
            return None
        arch = bytes(field.parts[field.data[0]]).decode()
        return GGUF_ARCHITECTURES.get(arch, arch)
    config = json.loads((source / "config.json").read_text())
    text = config.get("text_config") or {}
    value = config.get("model_type") or text.get("model_type")
    return str(value) if value else None


def check_supported(source: Path) -> None:
    """UnsupportedModelError unless the checkpoint is of a family we serve."""
    family = model_type_of(source)
    if family in SUPPORTED_FAMILIES:
        return
    said = f"model type {family!r}" if family else "a model whose config names no model_type"
    raise UnsupportedModelError(
        f"{said} is not supported: pagedserve serves {', '.join(sorted(SUPPORTED_FAMILIES))} "
        "(docs/models.md)")


def layer_windows(config: Any, num_layers: int) -> tuple[int, ...]:
    """Per layer, the sliding window its attention has (0: full), as transformers' modules
    apply it: `sliding_window` on every layer, or on the `layer_types` "sliding_attention"
    ones where the config lists them (Qwen2's max_window_layers, Gemma 3); none unless
    `use_sliding_window` allows. () when no layer slides."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return ()
    types = getattr(config, "layer_types", None)
    if types:
        windows = tuple(int(window) if t == "sliding_attention" else 0
                        for t in types[:num_layers])
    else:
        windows = (int(window),) * num_layers
    return windows if any(windows) else ()


def released_window(windows: tuple[int, ...]) -> int:
    """The window beyond which a sequence's KV blocks may be released: only when every layer
    slides (then the widest window; Mistral v0.1). 0 when any layer sees the whole context
    (Gemma 3's global layers, Qwen2's full layers): those keep every block."""
    return max(windows) if windows and all(windows) else 0


def logit_transform(config: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a family's CausalLM forward does to the LM head's output, for a step that
    applies the head itself (the compiled step): Granite divides by `logits_scaling`,
    Cohere multiplies by `logit_scale`, Gemma 2/3 soft-cap by `final_logit_softcapping`.
    None: the head's output is the logits (every other family served)."""
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1.0):
        return lambda logits: logits / scaling
    scale = getattr(config, "logit_scale", None)
    if scale not in (None, 1.0):
        return lambda logits: logits * scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        return lambda logits: (logits / cap).tanh() * cap
    return None
