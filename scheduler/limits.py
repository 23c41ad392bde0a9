"""EngineLimits: the facts fixed when the model is loaded that every layer checks against.

Built once by the engine at load (from the model, the KV pool and the config) and read by the
scheduler, the AsyncEngine and the API, so no limit is derived in more than one place.
Pure data, standard library only (the scheduler and the API import it without torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_model_len: int  # longest sequence (prompt + output): model, config and KV pool agree
    num_kv_blocks: int  # blocks in the KV pool
    block_size: int  # tokens per KV block
    vocab_size: int  # valid token ids are [0, vocab_size)
    eos_token_ids: frozenset[int]  # tokens that end a sequence unless ignore_eos
    # A prompt text longer than this (UTF-8 bytes) cannot tokenize into max_prompt_len tokens,
    # so it is refused before the (costly: ~1 s/MB) tokenization; None: no such bound known.
    max_prompt_bytes: int | None = None
    # Every layer of the model attends only to its last this-many tokens (Mistral v0.1): the
    # scheduler releases blocks that fall out of it while a sequence runs. 0: some layer sees
    # the whole context (full attention, or mixed like Gemma 3), so every block is kept.
    sliding_window: int = 0

    @property
    def max_prompt_len(self) -> int:
        """A prompt must leave room for at least one generated token."""
        return self.max_model_len - 1
