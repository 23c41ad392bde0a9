"""Errors the scheduler raises for requests it cannot take (mapped to HTTP by api/errors.py)."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class: a request the scheduler refuses, with a message fit for the client."""


class InvalidParamError(SchedulerError, ValueError):
    """A request parameter the engine refuses (bad value, token id outside the vocabulary).

    `param` names the field, so the API's 400 says which one without parsing the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(SchedulerError):
    """The prompt (plus at least one new token) can never fit: max_model_len or the KV pool."""


class QueueFullError(SchedulerError):
    """The waiting queue is at its bound (count or tokens): try again later.

    `limit` names the bound that refused it (max_num_queued_reqs or max_num_queued_tokens),
    for the rejection metric. When to come back is the API's answer (Retry-After, from the
    engine's measured drain rate): the scheduler has no clock."""

    def __init__(self, message: str, limit: str = "max_num_queued_reqs") -> None:
        super().__init__(message)
        self.limit = limit
