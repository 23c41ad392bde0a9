"""Random checkpoints with the shapes of the models people serve, made on demand and cached
(never downloaded, never in the default test run): the benchmarks' 1B- and 8B-class models.

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
    # Llama-3.1-8B's decoder (untied head, GQA 32/8, head_dim 128): 7.0B parameters with
    # this vocabulary, 14 GB in bf16; written tensor by tensor, never whole in memory.
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "tie_word_embeddings": False, "max_position_embeddings": 8192,
                 "rope_theta": 500000.0},
}
SHARD_BYTES = 2 << 30  # safetensors shards of about 2 GiB, as the hub's checkpoints
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
    """Generated and written one tensor at a time into ~2 GiB shards (an 8B model does not fit
    in memory twice here), each tensor from its own seeded generator."""
    import json

    import torch
    import transformers
    from safetensors.torch import save_file
    from tqdm import tqdm

    from benchmarks.common import model_folder

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_folder())
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, dtype="bfloat16", **SHAPES[shape])
    log.info("building a random %s checkpoint in %s", shape, folder)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    params = [(n, p.shape) for n, p in model.named_parameters()]  # a tied head is not listed
    folder.mkdir(parents=True)
    shard: dict[str, torch.Tensor] = {}
    names: list[list[str]] = []
    total = sum(torch.Size(s).numel() for _, s in params) * 2

    def flush() -> None:
        names.append(list(shard))
        save_file(shard, str(folder / f"part-{len(names):05d}.safetensors"),
                  metadata={"format": "pt"})
        shard.clear()

    with tqdm(total=total, unit="B", unit_scale=True, desc=f"random {shape}") as bar:
        for index, (name, size) in enumerate(params):
            if name.endswith("norm.weight"):
                tensor = torch.ones(size, dtype=torch.bfloat16)
            else:
                gen = torch.Generator().manual_seed(SEED * 100_003 + index)
                tensor = torch.empty(size, dtype=torch.bfloat16).normal_(0.0, WEIGHT_STD,
                                                                         generator=gen)
            shard[name] = tensor
            bar.update(tensor.numel() * 2)
            if sum(t.numel() * 2 for t in shard.values()) >= SHARD_BYTES:
                flush()
    if shard:
        flush()
    count = len(names)
    weight_map = {}
    for i, keys in enumerate(names, start=1):
        path = folder / f"part-{i:05d}.safetensors"
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        path.rename(folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.architectures = ["LlamaForCausalLM"]  # what save_pretrained writes; converters read it
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
