"""Tiny models for tests: random Llama / Qwen checkpoints saved to disk (so the real loading
code runs), their runners, and a small driver that plays the scheduler."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello tokens!",
          "Paged attention keeps the KV cache in blocks.", "0123456789 + - * / = ( )"] * 20


def build_tokenizer(folder: Path) -> None:
    """A byte-level BPE of ~300 tokens trained in milliseconds, saved as an HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)


# Each family's tiny shape beyond the common one; the name is transformers' class prefix
# ("Config/Model" where the two differ).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {}),
    "qwen2": ("Qwen2", {"tie_word_embeddings": True}),
    # q/k norms and an explicit head_dim (32 != hidden / heads)
    "qwen3": ("Qwen3", {"head_dim": 32}),
    "mistral": ("Mistral", {"sliding_window": None}),
    # Sliding windows of 8 tokens, against prompts of 13-42: every layer, or the second only.
    "mistral_window": ("Mistral", {"sliding_window": 8}),
    "qwen2_window": ("Qwen2", {"use_sliding_window": True, "sliding_window": 8,
                               "max_window_layers": 1}),
    # Gemma 3's text model: a local (sliding) layer and a global one, each with its own RoPE.
    # Gemma's embeddings are scaled by sqrt(hidden): tied to the head, a tiny random one only
    # repeats a token, so Gemma 2's and 3's heads are their own (varied greedy text).
    "gemma3_text": ("Gemma3Text/Gemma3", {"head_dim": 16, "sliding_window": 8,
                                          "tie_word_embeddings": False,
                                          "layer_types": ["sliding_attention",
                                                          "full_attention"]}),
    # Gemma 2: local and global layers, and both soft caps set low enough to bite on tiny
    # random logits (its defaults, 50 and 30, barely would; the attention's changes greedy
    # tokens, the final one cannot: tanh keeps the argmax).
    "gemma2": ("Gemma2", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                          "tie_word_embeddings": False,
                          "layer_types": ["sliding_attention", "full_attention"],
                          "attn_logit_softcapping": 1.0, "final_logit_softcapping": 5.0}),
    # gpt-oss: attention sinks, local and global layers (YaRN RoPE), biased q/k/v/o, and MoE
    # experts with biases and a clamped SwiGLU.
    "gpt_oss": ("GptOss", {"head_dim": 16, "sliding_window": 8, "num_local_experts": 4,
                           "num_experts_per_tok": 2,
                           "layer_types": ["sliding_attention", "full_attention"],
                           "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 128,
                                               "rope_theta": 150000.0, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False}}),
    "phi3": ("Phi3", {}),  # fused qkv_proj and gate_up_proj in the checkpoint
    "granite": ("Granite", {"embedding_multiplier": 2.0, "attention_multiplier": 0.25,
                            "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    "olmo2": ("Olmo2", {}),  # norms after attention and MLP, q/k norms over all heads
    "smollm3": ("SmolLM3", {"no_rope_layer_interval": 2}),  # every 2nd layer without RoPE
    "qwen3_moe": ("Qwen3Moe", {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 32, "decoder_sparse_step": 1}),
    "phi": ("Phi", {}),
    "gemma": ("Gemma", {"head_dim": 16}),
    "olmo": ("Olmo", {}),
    "cohere": ("Cohere", {}),
    "starcoder2": ("Starcoder2", {"sliding_window": None}),
    "glm": ("Glm", {}),
}


def build_checkpoint(folder: Path, arch: str) -> Path:
    import transformers

    build_tokenizer(folder)
    vocab = len(transformers.AutoTokenizer.from_pretrained(folder))
    common: dict[str, Any] = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 1,
              "pad_token_id": 1}
    torch.manual_seed(0)
    name, extra = FAMILIES[arch]
    config_name, model_name = (name, name) if "/" not in name else name.split("/")
    config = getattr(transformers, f"{config_name}Config")(**common, **extra)
    model: PreTrainedModel = getattr(transformers, f"{model_name}ForCausalLM")(config)
    # Larger-than-default weights spread the logits, so greedy ties (fp noise flips) are rare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
            elif name.endswith(".sinks"):  # gpt-oss: sinks that take a real share of attention
                p.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    return folder


def tiny_config(model: Path | str | None, **engine: object) -> EngineConfig:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                            block_size=4)
    opts: dict[str, object] = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 128,
                             "enforce_eager": True}  # compiled tests ask for compile
    opts.update(engine)
    return EngineConfig(model=None if model is None else str(model), scheduler=sched,
                        **opts)  # type: ignore[arg-type]


def loaded_runner(config: EngineConfig) -> ModelRunner:
    runner = ModelRunner(config)
    runner.load()
    return runner


class BlockAllocator:
    """Hands out pool blocks in a shuffled order, so block tables are never contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def cover(self, seq: Sequence, num_tokens: int, block_size: int) -> None:
        while len(seq.block_table) * block_size < num_tokens:
            seq.block_table.append(self.free.pop())


def greedy_seq(seq_id: str, prompt: list[int], max_tokens: int, **params: object) -> Sequence:
    return Sequence(seq_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True, **params))  # type: ignore[arg-type]


def drive(runner: ModelRunner, seqs: list[Sequence], chunk: int,
          start_step: list[int] | None = None,
          on_output: Callable[[SchedulerOutput, object], None] | None = None) -> None:
    """Play the scheduler: each step gives every admitted, unfinished sequence min(chunk,
    missing) tokens, then appends the sampled tokens, until every sequence has max_tokens."""
    alloc = BlockAllocator(runner.num_kv_blocks)
    starts = start_step or [0] * len(seqs)
    step = 0
    while any(s.num_output_tokens < s.params.max_tokens for s in seqs):
        batch = SchedulerOutput()
        for seq, first in zip(seqs, starts, strict=True):
            if first <= step and seq.num_output_tokens < seq.params.max_tokens:
                n = min(chunk, seq.num_uncomputed_tokens)
                alloc.cover(seq, seq.num_computed_tokens + n, runner.block_size)
                batch.seqs.append(seq)
                batch.num_scheduled_tokens.append(n)
        out = runner.execute(batch)
        if on_output is not None:
            on_output(batch, out)
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            seq.num_computed_tokens += n
            if seq.seq_id in out.sampled_token_ids:
                seq.append_token(out.sampled_token_ids[seq.seq_id])
        step += 1

