"""Calling a chat model: timeouts, retries with backoff that honour the provider's retry delay, an optional
rate limiter, and failures classified into the named states a run ends in.

Providers raise their own exception types (google.api_core / google.genai errors, openai.RateLimitError,
anthropic.APIStatusError, httpx errors); importing all of them would make every integration a dependency,
so classification reads what they have in common: an HTTP status (`status_code`, `code`, `response`), the
class name, and the message. A failure that survives the retries becomes `ModelCallError` with a `kind`
from `FAILURE_KINDS`; the graph lets it end the run (resumable from the failed node), never turns it into
"the model produced nothing, carry on".
"""

from __future__ import annotations

import contextvars
import queue
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# kind → (what the user reads, whether waiting and retrying can help)
FAILURE_KINDS: dict[str, tuple[str, bool]] = {
    "rate_limited": ("the provider refused the call for rate or quota (HTTP 429)", True),
    "model_timeout": ("the model did not answer within the request timeout", True),
    "model_unavailable": ("the model could not be reached (network, server down, unknown model, key)", True),
    "model_auth": ("the provider rejected the credentials (HTTP 401/403)", False),
    "model_not_found": ("the provider does not know this model (HTTP 404)", False),
    "model_error": ("the provider answered with an error", False),
    "model_bad_reply": ("the model's replies could not be used (empty, truncated or no code)", False),
}

_RETRY_IN = re.compile(r"(?:retry in|retry after|retry_delay|retryDelay)[^0-9]{0,20}([0-9]+(?:\.[0-9]+)?)\s*(ms|s)?",
                       re.IGNORECASE)  # fmt: skip


class ModelCallError(Exception):
    """A model call that failed for good (after retries). `kind` is one of FAILURE_KINDS."""

    def __init__(self, kind: str, message: str, *, attempts: int = 1, retry_after_s: float | None = None):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.detail = message
        self.attempts = attempts
        self.retry_after_s = retry_after_s

    @property
    def transient(self) -> bool:
        return FAILURE_KINDS.get(self.kind, ("", False))[1]


@dataclass(frozen=True)
class CallSettings:
    """How one model call is made. All of it is settable (Context fields, CLI flags)."""

    max_retries: int = 4
    timeout_s: float = 300.0
    backoff_initial_s: float = 2.0
    backoff_max_s: float = 120.0
    requests_per_second: float | None = None


def http_status(exc: BaseException) -> int | None:
    for attr in ("status_code", "code", "status"):
        value = getattr(exc, attr, None)
        value = getattr(value, "value", value)  # grpc / enum codes
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)
    value = getattr(response, "status_code", None)
    if isinstance(value, int):
        return value
    m = re.search(r"\b(4\d\d|5\d\d)\b", str(exc)[:200])
    return int(m.group(1)) if m else None


def retry_delay_s(exc: BaseException) -> float | None:
    """The provider's suggested wait: a `retry_after`/`retry_delay` attribute, a Retry-After header, or
    Gemini's RetryInfo (`retryDelay: '37s'` / 'Please retry in 37.2s') in the message."""
    for attr in ("retry_after", "retry_delay", "retry_after_s"):
        value = getattr(exc, attr, None)
        if value is not None:
            seconds = getattr(value, "total_seconds", None)
            try:
                return float(seconds() if callable(seconds) else value)
            except (TypeError, ValueError):
                pass
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or {}
    try:
        header = headers.get("retry-after") or headers.get("Retry-After")
    except AttributeError:
        header = None
    if header:
        try:
            return float(header)
        except ValueError:
            pass
    m = _RETRY_IN.search(str(exc))
    if m:
        value = float(m.group(1))
        return value / 1000 if (m.group(2) or "").lower() == "ms" else value
    return None


def classify(exc: BaseException) -> str:
    """The FAILURE_KINDS key for a provider exception."""
    name = type(exc).__name__.lower()
    text = str(exc).lower()
    status = http_status(exc)
    if status == 429 or "ratelimit" in name or "resourceexhausted" in name or "resource_exhausted" in text:
        return "rate_limited"
    if "rate limit" in text or "quota" in text:
        return "rate_limited"
    if isinstance(exc, TimeoutError) or "timeout" in name or "deadline" in name or status in (408, 504):
        return "model_timeout"
    if "timed out" in text:
        return "model_timeout"
    if status in (401, 403) or "permissiondenied" in name or "authentication" in name:
        return "model_auth"
    if "api key not valid" in text or "invalid api key" in text:
        return "model_auth"
    if status == 404 or name == "notfound" or "notfounderror" in name:
        return "model_not_found"
    if isinstance(exc, ConnectionError | OSError) or "connect" in name or "unavailable" in name:
        return "model_unavailable"
    if status in (500, 502, 503) or "connection" in text:
        return "model_unavailable"
    return "model_error"


def backoff_s(attempt: int, settings: CallSettings, suggested: float | None) -> float:
    """Exponential backoff with jitter; a provider's suggested delay wins when it is longer."""
    base = min(settings.backoff_max_s, settings.backoff_initial_s * (2**attempt))
    wait = base * (0.5 + random.random() / 2)
    if suggested is not None:
        wait = max(wait, suggested)
    return min(wait, max(settings.backoff_max_s, suggested or 0.0))


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run `fn` in a daemon thread and give up after `timeout_s`: a stalled HTTP call must not hang the run
    (the provider's own timeout is also set where the integration has one)."""
    box: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
    context = contextvars.copy_context()  # tracing/callback context follows the call into its thread

    def target() -> None:
        try:
            box.put((True, context.run(fn)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as is
            box.put((False, exc))

    threading.Thread(target=target, daemon=True, name="model-call").start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"no reply within {timeout_s:.0f} s") from None
    if ok:
        return value
    raise value


def invoke_with_retries(
    model: Any,
    messages: Any,
    settings: CallSettings,
    *,
    rate_limiter: Any = None,
    sleep: Callable[[float], None] = time.sleep,
    on_failure: Callable[[str, BaseException], None] | None = None,
) -> Any:
    """`model.invoke(messages)` with the timeout, the limiter and retries of transient failures.
    `on_failure(kind, exc)` sees every failed attempt (usage accounting). Raises ModelCallError."""
    attempt = 0
    while True:
        if rate_limiter is not None:
            rate_limiter.acquire(blocking=True)
        try:
            return call_with_timeout(lambda: model.invoke(messages), settings.timeout_s)
        except Exception as exc:  # noqa: BLE001 - every provider error is classified below
            kind = classify(exc)
            if on_failure is not None:
                on_failure(kind, exc)
            suggested = retry_delay_s(exc)
            transient = FAILURE_KINDS[kind][1]
            if not transient or attempt >= settings.max_retries:
                raise ModelCallError(
                    kind,
                    f"{type(exc).__name__}: {str(exc)[:500]}",
                    attempts=attempt + 1,
                    retry_after_s=suggested,
                ) from exc
            sleep(backoff_s(attempt, settings, suggested))
            attempt += 1


def make_rate_limiter(requests_per_second: float | None) -> Any:
    if not requests_per_second:
        return None
    from langchain_core.rate_limiters import InMemoryRateLimiter

    return InMemoryRateLimiter(
        requests_per_second=requests_per_second, check_every_n_seconds=0.05, max_bucket_size=1
    )
