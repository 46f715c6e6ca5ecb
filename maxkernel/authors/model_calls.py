"""Calling a chat model: timeouts that cancel the request, retries with backoff that honour the provider's
retry delay, an optional rate limiter, run budgets checked before every attempt, and failures classified
into the named states a run ends in.

This module is the ONE layer that retries model calls. The providers' SDK retries are switched off where the
model is made (`authors.llm.init_model`: `max_retries=0`), and the graph has no node-level retry for model
failures: a step whose call failed for good ends the run in a named, resumable state. One layer means the
attempts a user asked for (`--model-retries`) are the attempts made, each one counted and each one checked
against the run's budgets, and the error says how many there were.

Providers raise their own exception types. The LangChain integrations wrap them in
`langchain_core.exceptions.ModelError` subclasses (`ModelRateLimitError`, `ModelAPIError` for 5xx and
Anthropic's 529 overloaded, ...) that also inherit the SDK's class, and carry the SDK's error as their cause
(langchain-google-genai keeps the HTTP response only there). Classification reads, along the cause chain:
LangChain's class and its `is_retryable`, the HTTP status (`status_code`, `code`, `response`), the
provider's `x-should-retry` header, then class names and the message. The provider's suggested wait comes
from `retry-after-ms` (OpenAI, Anthropic), `Retry-After` in seconds or as an HTTP date, or Gemini's
RetryInfo (`retryDelay: '37s'`). A failure that survives the retries becomes `ModelCallError` with a
`kind` from `FAILURE_KINDS`; the graph lets it end the run (resumable from the failed node).
"""

from __future__ import annotations

import asyncio
import contextvars
import email.utils
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from langchain_core import exceptions as lc_errors

from maxkernel.authors.base import BudgetSpent

# kind → (what the user reads, whether waiting and retrying can help)
FAILURE_KINDS: dict[str, tuple[str, bool]] = {
    "rate_limited": ("the provider refused the call for rate or quota (HTTP 429)", True),
    "model_timeout": ("the model did not answer within the request timeout", True),
    "model_unavailable": (
        "the model could not be reached or is overloaded (network, HTTP 5xx / 529, server down)",
        True,
    ),
    "model_auth": ("the provider rejected the credentials (HTTP 401/403)", False),
    "model_not_found": ("the provider does not know this model (HTTP 404)", False),
    "model_error": ("the provider answered with an error", False),
    "model_bad_reply": ("the model's replies could not be used (empty, truncated or no code)", False),
}

# LangChain's provider-independent error classes → our kinds (first match along the cause chain wins).
LANGCHAIN_KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (lc_errors.ModelRateLimitError, "rate_limited"),
    (lc_errors.ModelTimeoutError, "model_timeout"),
    (lc_errors.ModelConnectionError, "model_unavailable"),
    (lc_errors.ModelAPIError, "model_unavailable"),
    (lc_errors.ModelAuthenticationError, "model_auth"),
    (lc_errors.ModelPermissionDeniedError, "model_auth"),
    (lc_errors.ModelNotFoundError, "model_not_found"),
    (lc_errors.ModelInvalidRequestError, "model_error"),
    (lc_errors.ContextOverflowError, "model_error"),
)

# HTTP status → kind. 529 is Anthropic's "overloaded"; 408/504 are timeouts on the way.
STATUS_KINDS: dict[int, str] = {
    429: "rate_limited",
    408: "model_timeout",
    504: "model_timeout",
    401: "model_auth",
    403: "model_auth",
    404: "model_not_found",
    500: "model_unavailable",
    502: "model_unavailable",
    503: "model_unavailable",
    529: "model_unavailable",
}

ABANDON_WAIT_S = 10.0
"""How long a timed-out call that could not be cancelled (a model with no native async path runs in a
thread) may take to end before the retry is sent. The provider's own request timeout is set to the same
limit, so it normally ends at once; past this wait the retry is not sent, so two requests never overlap."""

CANCEL_SLACK_S = 5.0
"""How long a cancelled request may take to close its connection before the caller stops waiting for it."""

# "retryDelay': '37s'" (Gemini RetryInfo), "Please retry in 37.2s", "Please try again in 1m26.4s" (OpenAI)
_RETRY_IN = re.compile(r"(?:retry in|retry after|try again in|retry_delay|retryDelay)[^0-9]{0,20}"
                       r"(?P<delay>(?:[0-9]+(?:\.[0-9]+)?\s*(?:ms|h|m|s)?)+)", re.IGNORECASE)  # fmt: skip
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(ms|h|m|s)?", re.IGNORECASE)
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "": 1.0}


class ModelCallError(Exception):
    """A model call that failed for good (after retries). `kind` is one of FAILURE_KINDS; `attempts` is the
    number of requests actually sent for it; `retry_after_s` the provider's last suggested wait and
    `resume_after` (time.time()) when it said a new call may succeed, when it said so."""

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        attempts: int = 1,
        retry_after_s: float | None = None,
        resume_after: float | None = None,
    ):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.detail = message
        self.attempts = attempts
        self.retry_after_s = retry_after_s
        self.resume_after = resume_after

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


class CallGate(Protocol):
    """The run's budgets as the retry loop sees them (`LLMAuthor` builds one per call)."""

    def allow(self, messages: Any) -> float | None:
        """Before every attempt: raise `BudgetSpent` when no call may be made; else the seconds left on the
        wall-clock budget (None: no wall limit), which bounds the request timeout and any backoff."""
        ...

    def out_of_time(self) -> BudgetSpent:
        """The error that names the wall-clock budget (a call or a wait would run past it)."""
        ...


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it was raised from (or while handling), a few levels deep: integrations wrap the
    SDK's error and keep the HTTP response on the wrapped one."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 6:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _status_of(exc: BaseException) -> int | None:
    for attr in ("status_code", "code", "status"):
        value = getattr(exc, attr, None)
        value = getattr(value, "value", value)  # grpc / enum codes
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            return value
    value = getattr(getattr(exc, "response", None), "status_code", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def http_status(exc: BaseException) -> int | None:
    for e in causes(exc):
        status = _status_of(e)
        if status is not None:
            return status
    m = re.search(r"\b(4\d\d|5\d\d)\b", str(exc)[:200])
    return int(m.group(1)) if m else None


def header(exc: BaseException, name: str) -> str | None:
    """A response header of the provider's error (case-insensitive), from the first error in the cause chain
    that carries a response."""
    for e in causes(exc):
        headers = getattr(getattr(e, "response", None), "headers", None)
        if not headers:
            continue
        try:
            value = headers.get(name)
            if value is None:
                value = next((v for k, v in headers.items() if str(k).lower() == name), None)
        except (AttributeError, TypeError):
            continue
        if value is not None:
            return str(value)
    return None


def parse_retry_after(value: str, now: float | None = None) -> float | None:
    """`Retry-After` as delta-seconds or an HTTP date (RFC 9110), as seconds from `now` (never negative)."""
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_delay_s(exc: BaseException, now: float | None = None) -> float | None:
    """The provider's suggested wait: a `retry_after`/`retry_delay` attribute, the `retry-after-ms` header
    (OpenAI and Anthropic send it), `Retry-After` (seconds or an HTTP date), or Gemini's RetryInfo
    (`retryDelay: '37s'` / 'Please retry in 37.2s') in the message or the error's details."""
    for e in causes(exc):
        for attr in ("retry_after", "retry_delay", "retry_after_s"):
            value = getattr(e, attr, None)
            if value is not None:
                seconds = getattr(value, "total_seconds", None)
                try:
                    return float(seconds() if callable(seconds) else value)
                except (TypeError, ValueError):
                    pass
    millis = header(exc, "retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    after = header(exc, "retry-after")
    if after is not None:
        parsed = parse_retry_after(after, now)
        if parsed is not None:
            return parsed
    for e in causes(exc):
        for text in (str(e), str(getattr(e, "details", "") or "")):
            m = _RETRY_IN.search(text)
            if m:
                parts = _DURATION_PART.findall(m.group("delay"))
                return sum(float(n) * _UNIT_S[(unit or "").lower()] for n, unit in parts)
    return None


def classify(exc: BaseException) -> str:
    """The FAILURE_KINDS key for a provider exception."""
    chain = list(causes(exc))
    for e in chain:
        for cls, kind in LANGCHAIN_KINDS:
            if isinstance(e, cls):
                return kind
    status = http_status(exc)
    names = " ".join(type(e).__name__.lower() for e in chain)
    text = str(exc).lower()
    if status == 429 or "ratelimit" in names or "resourceexhausted" in names or "resource_exhausted" in text:
        return "rate_limited"
    if "rate limit" in text or "quota" in text:
        return "rate_limited"
    if any(isinstance(e, TimeoutError) for e in chain) or "timeout" in names or "deadline" in names:
        return "model_timeout"
    if status in (401, 403) or "permissiondenied" in names or "authentication" in names:
        return "model_auth"
    if "api key not valid" in text or "invalid api key" in text:
        return "model_auth"
    if status is not None and status in STATUS_KINDS:
        return STATUS_KINDS[status]
    if "timed out" in text:
        return "model_timeout"
    if _name_says_unavailable(names) or any(isinstance(e, ConnectionError) for e in chain):
        return "model_unavailable"
    if status is not None and status >= 500:
        return "model_unavailable"
    if isinstance(exc, OSError) or "connection" in text or "overloaded" in text:
        return "model_unavailable"
    for e in chain:  # a LangChain model error of a kind not listed: its own word on retrying
        if isinstance(e, lc_errors.ModelError):
            return "model_unavailable" if e.is_retryable else "model_error"
    return "model_error"


def _name_says_unavailable(names: str) -> bool:
    return any(word in names for word in ("connect", "unavailable", "overloaded", "servererror"))


def retryable(exc: BaseException, kind: str) -> bool:
    """Whether waiting and calling again can help: the provider's `x-should-retry` header when it sent one
    (the OpenAI and Anthropic SDKs obey it too), else LangChain's `is_retryable`, else the kind's rule."""
    should = header(exc, "x-should-retry")
    if should is not None and should.strip().lower() in ("true", "false"):
        return should.strip().lower() == "true"
    for e in causes(exc):
        if isinstance(e, lc_errors.ModelError):
            return bool(e.is_retryable) or FAILURE_KINDS[kind][1]
    return FAILURE_KINDS[kind][1]


def backoff_s(attempt: int, settings: CallSettings, suggested: float | None) -> float:
    """Exponential backoff with jitter; a provider's suggested delay wins when it is longer. Never more than
    `backoff_max_s` (a longer suggestion stops the retries instead: see `invoke_with_retries`)."""
    base = min(settings.backoff_max_s, settings.backoff_initial_s * (2**attempt))
    wait = base * (0.5 + random.random() / 2)
    return min(settings.backoff_max_s, max(wait, suggested or 0.0))


class _Call:
    """One request in its own thread and event loop, so a timeout can cancel it: the coroutine is cancelled
    and an async HTTP client closes the connection (the provider stops, nothing keeps running). A model with
    no native async path runs its sync call in the loop's executor, which cannot be interrupted: the thread
    stays alive until that call ends, and `wait_ended` tells (the retry waits for it)."""

    def __init__(self, runner: Any, messages: Any, timeout_s: float) -> None:
        self.box: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
        self.timeout_s = timeout_s
        self.expired = False  # our limit ended it (not an error the provider raised)
        context = contextvars.copy_context()  # tracing/callback context follows the call into its thread
        self.thread = threading.Thread(
            target=context.run,
            args=(asyncio.run, self._main(runner, messages)),
            daemon=True,
            name="model-call",
        )
        self.thread.start()

    async def _main(self, runner: Any, messages: Any) -> None:
        limit = asyncio.timeout(self.timeout_s)
        try:
            async with limit:
                if hasattr(runner, "ainvoke"):
                    value = await runner.ainvoke(messages)
                else:
                    value = await asyncio.to_thread(runner.invoke, messages)
            self.box.put((True, value))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as is
            if isinstance(exc, TimeoutError) and limit.expired():
                self.expired = True
                exc = TimeoutError(f"no reply within {self.timeout_s:.0f} s (the request was cancelled)")
            self.box.put((False, exc))

    def result(self) -> Any:
        try:
            ok, value = self.box.get(timeout=self.timeout_s + CANCEL_SLACK_S)
        except queue.Empty:
            self.expired = True
            raise TimeoutError(f"no reply within {self.timeout_s:.0f} s (the request did not stop)") from None
        if ok:
            return value
        raise value

    def wait_ended(self, seconds: float) -> bool:
        """Whether the request has ended (waiting up to `seconds` for one that could not be cancelled)."""
        self.thread.join(timeout=max(0.0, seconds))
        return not self.thread.is_alive()


def invoke_with_retries(
    model: Any,
    messages: Any,
    settings: CallSettings,
    *,
    rate_limiter: Any = None,
    sleep: Callable[[float], None] = time.sleep,
    on_failure: Callable[[str, BaseException], None] | None = None,
    gate: CallGate | None = None,
) -> Any:
    """`model.invoke(messages)` with the timeout, the limiter, the run's budgets (`gate`, asked before every
    attempt) and retries of transient failures. `on_failure(kind, exc)` sees every failed attempt (usage
    accounting). Raises ModelCallError, or BudgetSpent when a budget stops the next attempt or a wait.

    A provider that asks for a longer wait than `backoff_max_s` (a daily quota) is not waited for: the call
    fails as `rate_limited` at once, with `resume_after` saying when the provider expects to answer."""
    attempt = 0
    previous: _Call | None = None
    while True:
        left = gate.allow(messages) if gate is not None else None
        if previous is not None and not previous.wait_ended(min(ABANDON_WAIT_S, left or ABANDON_WAIT_S)):
            raise ModelCallError(
                "model_timeout",
                f"the request timed out after {previous.timeout_s:.0f} s and could not be cancelled (the model "
                "has no async path); it is still running, so it was not retried",
                attempts=attempt,
            )
        if rate_limiter is not None:
            rate_limiter.acquire(blocking=True)
        timeout = settings.timeout_s if left is None else min(settings.timeout_s, left)
        call = _Call(model, messages, timeout)
        try:
            return call.result()
        except Exception as exc:  # noqa: BLE001 - every provider error is classified below
            kind = classify(exc)
            if on_failure is not None:
                on_failure(kind, exc)
            if gate is not None and call.expired and timeout < settings.timeout_s:
                raise gate.out_of_time() from exc  # cut at the wall-clock budget, not at its own limit
            previous = call if kind == "model_timeout" else None
            suggested = retry_delay_s(exc)
            detail = f"{type(exc).__name__}: {str(exc)[:500]}"
            if not retryable(exc, kind) or attempt >= settings.max_retries:
                raise ModelCallError(kind, detail, attempts=attempt + 1, retry_after_s=suggested) from exc
            if suggested is not None and suggested > settings.backoff_max_s:
                raise ModelCallError(
                    kind,
                    f"the provider asks to wait {suggested:.0f} s before the next call, longer than the "
                    f"{settings.backoff_max_s:.0f} s this run waits between retries. {detail}",
                    attempts=attempt + 1,
                    retry_after_s=suggested,
                    resume_after=time.time() + suggested,
                ) from exc
            wait = backoff_s(attempt, settings, suggested)
            if gate is not None:
                left = gate.allow(messages)
                if left is not None and wait >= left:
                    raise gate.out_of_time() from exc
            sleep(wait)
            attempt += 1


def make_rate_limiter(requests_per_second: float | None) -> Any:
    if not requests_per_second:
        return None
    from langchain_core.rate_limiters import InMemoryRateLimiter

    return InMemoryRateLimiter(
        requests_per_second=requests_per_second, check_every_n_seconds=0.05, max_bucket_size=1
    )
