"""The simulated workload: multi-turn conversations that share system prompts.

A conversation picks one of `num_system_prompts` system prompts (uniformly, or Zipf-skewed so
a few are hot) and runs several turns. Turn k's prompt is the system prompt, then every
earlier user message and answer, then the new user message, so consecutive turns share all
but their newest tokens: that is what a prefix cache, and a router that keeps a conversation
on one replica, can save. Answers are planned here (token ids and lengths) and the simulated
replica "samples" exactly them (as with ignore_eos), so the next turn's prompt holds the
tokens the engine produced and the hit is real, not assumed.

Conversations start as a Poisson process; a follow-up turn arrives a think time (exponential)
after the previous answer ended, so a conversation never has two turns in flight.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

FIRST_TOKEN = 1000  # ids below are left out (EOS and special tokens live there)
VOCAB = 49152


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    num_requests: int = 400  # turns in all (about: whole conversations are generated)
    rate: float = 1.0  # requests per second, on average
    num_system_prompts: int = 8
    system_prompt_len: int = 512
    user_len: tuple[int, int] = (32, 128)
    output_len: tuple[int, int] = (32, 160)
    turns: tuple[int, int] = (1, 6)  # turns per conversation, uniform
    think_time_s: float = 2.0  # mean pause between an answer and the next user turn
    prefix_skew: float = 0.0  # Zipf exponent over system prompts; 0 = uniform
    max_model_len: int = 2048  # a conversation ends before a turn would not fit
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.num_requests < 1 or self.num_system_prompts < 1:
            raise ValueError("rate, num_requests and num_system_prompts must be positive")

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2


@dataclass(frozen=True, slots=True)
class Turn:
    prompt: tuple[int, ...]
    output: tuple[int, ...]  # the answer the replica will produce, token by token


@dataclass(frozen=True, slots=True)
class Conversation:
    conv_id: int
    start_s: float
    system_prompt: int  # index of its system prompt
    turns: tuple[Turn, ...]


def make_trace(cfg: WorkloadConfig) -> list[Conversation]:
    """The conversations of one run, in start order. Same config, same trace."""
    rng = random.Random(cfg.seed)
    systems = [_tokens(rng, cfg.system_prompt_len) for _ in range(cfg.num_system_prompts)]
    weights = [1.0 / (i + 1) ** cfg.prefix_skew for i in range(cfg.num_system_prompts)]
    conv_rate = cfg.rate / cfg.mean_turns
    convs: list[Conversation] = []
    t, total = 0.0, 0
    while total < cfg.num_requests:
        t += rng.expovariate(conv_rate)
        k = rng.choices(range(cfg.num_system_prompts), weights)[0]
        turns = _turns(rng, cfg, systems[k], rng.randint(*cfg.turns))
        convs.append(Conversation(len(convs), t, k, turns))
        total += len(turns)
    return convs


def _turns(rng: random.Random, cfg: WorkloadConfig, system: list[int], n: int
           ) -> tuple[Turn, ...]:
    history = list(system)
    turns: list[Turn] = []
    for _ in range(n):
        prompt = history + _tokens(rng, rng.randint(*cfg.user_len))
        output = _tokens(rng, rng.randint(*cfg.output_len))
        if len(prompt) + len(output) > cfg.max_model_len:
            break
        turns.append(Turn(tuple(prompt), tuple(output)))
        history = prompt + output
    if not turns:  # the system prompt alone is too long: one short turn still runs
        turns.append(Turn(tuple(system[: cfg.max_model_len // 2]), (FIRST_TOKEN,)))
    return tuple(turns)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(n)]


def expected_requests(convs: list[Conversation]) -> int:
    return sum(len(c.turns) for c in convs)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]
