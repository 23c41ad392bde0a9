"""AppState: what the routes share, kept on app.state (no module globals)."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request

from api.errors import APIError, bad_request, from_engine_error, not_ready
from api.lifecycle import Lifecycle
from api.metrics import ServerMetrics
from api.requests.params import check_unicode
from engine.protocol import EngineClient, EngineDeadError, EngineLimits

logger = logging.getLogger("pagedserve.api")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class AppState:
    engine: EngineClient
    metrics: ServerMetrics
    served_model_name: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout: float | None = None  # --request-timeout: seconds, for every request
    trust_request_chat_template: bool = False  # --trust-request-chat-template
    lifecycle: Lifecycle = field(default_factory=Lifecycle)

    @staticmethod
    def of(request: Request) -> AppState:
        return AppState.of_app(request.app)

    @staticmethod
    def of_app(app: Starlette) -> AppState:
        state = app.state.pagedserve
        assert isinstance(state, AppState)
        return state

    def check_model(self, model: str | None) -> None:
        """A missing model means the served one (vLLM); any other name is a 404."""
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")

    def check_ready(self) -> None:
        if not self.engine.is_ready():
            raise not_ready()

    def limits(self) -> EngineLimits:
        """The engine's limits (max_model_len...); 503 while the model is still loading."""
        limits = self.engine.limits
        if limits is None:
            raise not_ready()
        return limits

    def check_admitting(self) -> None:
        """New generation requests: 503 while shutting down (counted) or not ready."""
        try:
            self.lifecycle.check_admitting()
        except APIError as e:
            if e.reason is not None:
                self.metrics.reject(e.reason)
            raise
        self.check_ready()

    def deadline(self, arrival: float, timeout: float | None) -> float | None:
        """The request's deadline (time.monotonic()): the tighter of its own `timeout`
        and --request-timeout, counted from its arrival."""
        limits = [t for t in (timeout, self.request_timeout) if t is not None]
        return arrival + min(limits) if limits else None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(prefix: str, given: str | None) -> tuple[str, str]:
    """(the response's id, a unique prefix for its engine requests). A client's request_id
    names the response (as vLLM's); the engine's ids stay unique even when clients reuse it."""
    engine_id = new_request_id(prefix)
    return (engine_id if given is None else f"{prefix}-{given}"), engine_id


def now() -> int:
    return int(time.time())


async def tokenize_text(engine: EngineClient, text: str, add_special_tokens: bool,
                        param: str, limits: EngineLimits | None = None,
                        fit_factor: int = 1) -> list[int]:
    """engine.tokenize (off the event loop). A text that is not valid Unicode (a lone UTF-16
    surrogate, which JSON allows) is a 400 naming where it is; anything else the tokenizer
    raises on is a 400 too, whose message does not echo the tokenizer's internals. Given
    the limits, a text too long to ever fit (fit_factor times over, for a prompt that will be
    truncated) is refused before it is tokenized."""
    check_unicode(text, param)
    if limits is not None:
        check_text_fits(text, limits, param, fit_factor)
    try:
        return await engine.tokenize(text, add_special_tokens=add_special_tokens)
    except EngineDeadError as e:
        raise from_engine_error(e, engine.stats()) from None
    except Exception as e:  # noqa: BLE001 - tokenizers raise various types on bad text
        logger.warning("tokenizer refused a %s: %s: %s", param, type(e).__name__, e)
        raise bad_request(f"{param} cannot be tokenized", param=param) from None


def check_text_fits(text: str, limits: EngineLimits, param: str, factor: int = 1) -> None:
    """A 400 for a text that tokenizes to more than `factor` times max_model_len tokens
    however it splits (every token covers at most so many bytes): no tokenizer time is spent
    on it."""
    if limits.max_prompt_bytes is None:
        return
    cap = limits.max_prompt_bytes * factor
    if len(text) * 4 <= cap:  # 4 bytes per character at most: no encode
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size <= cap:
        return
    times = "" if factor == 1 else f"{factor} times "
    raise APIError(400, f"{param} is {size} bytes long, more than {times}any text of this "
                   f"model's maximum context length ({limits.max_model_len} tokens) can be",
                   param=param, code="context_length_exceeded")
