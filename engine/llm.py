"""LLM: offline batch generation from Python, on the same engine the server uses.

    from engine.llm import LLM
    from scheduler import SamplingParams
    llm = LLM()                                   # the embedded SmolLM2, dtype auto
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from engine.config import EngineConfig, make_config
from engine.core.llm_engine import LLMEngine
from engine.outputs import RequestOutput, TokenLogprobs
from scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class Completion:
    """The whole result of one prompt (deltas concatenated)."""

    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # the engine failed this prompt (finish_reason is then "abort")

    def add(self, out: RequestOutput) -> None:
        if out.prompt_token_ids is not None:
            self.prompt_token_ids = list(out.prompt_token_ids)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        self.token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        self.logprobs.extend(out.logprobs or ())
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        self.num_cached_tokens = out.num_cached_tokens
        self.error = out.error


class LLM:
    def __init__(self, config: EngineConfig | None = None, **options: Any) -> None:
        """Either a ready EngineConfig or flat options (model=..., dtype=..., num_kv_blocks=...)."""
        self.engine = LLMEngine(config if config is not None else make_config(options))
        self.engine.load()
        self._next_id = 0

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[Completion]:
        """Run every prompt to completion (continuous batching), results in prompt order."""
        plist = _broadcast(params, len(prompts))
        results: dict[str, Completion] = {}
        try:
            for prompt, p in zip(prompts, plist):
                rid = f"offline-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, prompt, p)
                results[rid] = Completion(rid)
        except Exception:  # a bad prompt: take back the ones already queued, then report it
            for rid in results:
                self.engine.abort_request(rid)
            raise
        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished():
            if not self.engine.has_runnable():
                self.engine.wait_for_grammars()  # only structured-output compiles pending
            for out in self.engine.step():
                results[out.request_id].add(out)
                bar.update(int(out.finished))
        bar.close()
        failed = [c for c in results.values() if c.error is not None]
        if failed:  # as vLLM's LLM: a prompt the engine failed is an error, never empty text
            raise GenerationError(failed, list(results.values()))
        return list(results.values())


class GenerationError(RuntimeError):
    """The engine failed some prompts (a failed step: see the log). `completions` holds every
    prompt's result, in prompt order, the failed ones with their `error`."""

    def __init__(self, failed: list[Completion], completions: list[Completion]) -> None:
        super().__init__(f"{len(failed)} of {len(completions)} prompt(s) failed: "
                         f"{failed[0].error}")
        self.completions = completions


def _broadcast(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
