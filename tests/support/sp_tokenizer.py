"""Small SentencePiece-style tokenizers built in-process with the `tokenizers` library: '▁' for
spaces and <0xNN> byte-fallback pieces for whatever the trained vocabulary lacks."""

from __future__ import annotations

import json
from collections.abc import Sequence

from engine.tokenizer import Tokenizer


def sentencepiece_tokenizer(corpus: Sequence[str], strip_first_space: bool = True) -> Tokenizer:
    """A BPE of ~150 pieces trained on `corpus`, plus the 256 byte pieces. With
    `strip_first_space` its decoder drops the text's leading space (Llama 2's
    Replace/ByteFallback/Fuse/Strip); without, the space stays (Gemma's)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = RawTokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"]))
    model = json.loads(trained.to_str())["model"]
    vocab = model["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) for m in model["merges"]]
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                  byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizer
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    raw.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip_first_space
                                             else []))
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>",
                                             eos_token="</s>", unk_token="<unk>"))
