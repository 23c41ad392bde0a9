"""Continuous-batching policy and KV block accounting. Standard library only."""

from scheduler.config import SchedulerConfig
from scheduler.errors import PromptTooLongError, QueueFullError, SchedulerError
from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence, SequenceStatus

__all__ = [
    "PromptTooLongError", "QueueFullError", "SamplingParams", "SchedulerConfig", "SchedulerError",
    "SchedulerOutput", "Sequence", "SequenceStatus",
]
