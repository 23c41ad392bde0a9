"""Errors the scheduler raises for requests it cannot take (mapped to HTTP by api/errors.py)."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class: a request the scheduler refuses, with a message fit for the client."""


class PromptTooLongError(SchedulerError):
    """The prompt (plus at least one new token) can never fit: max_model_len or the KV pool."""


class QueueFullError(SchedulerError):
    """The waiting queue is at its bound (count or tokens): try again later.

    `limit` names the bound that refused it (max_num_queued_reqs or max_num_queued_tokens),
    for the rejection metric. `retry_after_s` is filled in by whoever knows how fast the
    queue drains (the AsyncEngine); the scheduler has no clock."""

    def __init__(self, message: str, limit: str = "max_num_queued_reqs") -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s: float | None = None
