"""Random checkpoints with the shapes of the models people serve, made on demand and cached
(never downloaded, never in the default test run): the benchmarks' 1B-class model.

The weights are random (fixed seed) with a scale that keeps greedy text varied (no token
repeated forever), so early stops or speculation cannot flatter a server; the tokenizer is
the embedded SmolLM2's (vocab 49152).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Llama-3.2-1B's decoder (tied embeddings, GQA 32/8, head_dim 64) with SmolLM2's vocabulary.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                 "tie_word_embeddings": True, "max_position_embeddings": 8192,
                 "rope_theta": 500000.0},
}
WEIGHT_STD = 0.02  # Llama's own init: varied greedy text at these widths
SEED = 0


def random_model(shape: str, cache: Path | None = None) -> Path:
    """The folder of a random `shape` checkpoint (bf16 safetensors + tokenizer), made once."""
    from engine.worker.cache_paths import cache_root

    folder = (cache or cache_root() / "bench-models") / shape
    if (folder / "config.json").exists():
        return folder
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    _build(shape, tmp)
    tmp.rename(folder)
    return folder


def _build(shape: str, folder: Path) -> None:
    import torch
    import transformers

    from benchmarks.common import model_folder

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_folder())
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **SHAPES[shape])
    log.info("building a random %s checkpoint in %s", shape, folder)
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)  # type: ignore[arg-type]
    with torch.no_grad():  # straight in bf16: no fp32 copy of the whole model
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, WEIGHT_STD)
    model.tie_weights()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
