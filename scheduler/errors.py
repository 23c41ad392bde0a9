"""Errors the scheduler raises for requests it cannot take (mapped to HTTP by api/errors.py)."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class: a request the scheduler refuses, with a message fit for the client."""


class PromptTooLongError(SchedulerError):
    """The prompt (plus at least one new token) can never fit: max_model_len or the KV pool."""


class QueueFullError(SchedulerError):
    """The waiting queue is at its bound (count or tokens): try again later."""
