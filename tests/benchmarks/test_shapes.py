"""benchmarks/shapes.py: a random checkpoint written tensor by tensor into several shards
loads back whole, with the seeded weights, and is made once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from benchmarks import shapes


def test_a_sharded_random_checkpoint_loads_whole_and_is_reused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "tie_word_embeddings": False, "max_position_embeddings": 256}
    monkeypatch.setitem(shapes.SHAPES, "tiny", tiny)
    monkeypatch.setattr(shapes, "SHARD_BYTES", 2 << 20)  # each 6 MB table ends a shard
    folder = shapes.random_model("tiny", cache=tmp_path)
    assert len(list(folder.glob("model-*-of-*.safetensors"))) == 2
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, output_loading_info=True)
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"]
    layer = model.model.layers[1]
    assert torch.equal(layer.input_layernorm.weight, torch.ones(64, dtype=torch.bfloat16))
    std = layer.mlp.up_proj.weight.float().std().item()
    assert abs(std - shapes.WEIGHT_STD) < 0.1 * shapes.WEIGHT_STD
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # untied
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert shapes.random_model("tiny", cache=tmp_path) == folder
    assert (folder / "config.json").stat().st_mtime_ns == stamp  # found, not rebuilt
