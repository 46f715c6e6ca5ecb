"""Provider retry rules read as the Google, OpenAI and Anthropic integrations actually raise them: the failure
kind, whether to retry (LangChain's `is_retryable`, the provider's `x-should-retry`), the provider's delay in
every header form, a delay longer than the run will wait, and a timed-out request cancelled (never left
running under its retry). The exceptions come from `provider_errors` (the integrations' own classes)."""

from __future__ import annotations

import email.utils
import threading
import time
from typing import Any

import pytest
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.exceptions import ModelError
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult

import maxkernel.authors.model_calls as model_calls
from fake_chat import EventChatModel, StallingChatModel
from maxkernel.authors.base import BudgetSpent
from maxkernel.authors.model_calls import (
    CallSettings,
    ModelCallError,
    classify,
    invoke_with_retries,
    parse_retry_after,
    retry_delay_s,
    retryable,
)
from provider_errors import (
    anthropic_error,
    anthropic_overloaded,
    gemini_daily_quota,
    gemini_error,
    openai_error,
    openai_timeout,
)

FAST = CallSettings(max_retries=3, timeout_s=5.0, backoff_initial_s=0.001, backoff_max_s=120.0)


def http_date(seconds_from_now: float) -> str:
    return email.utils.formatdate(time.time() + seconds_from_now, usegmt=True)


@pytest.mark.parametrize(
    ("make", "kind", "retry"),
    [
        (lambda: gemini_error(429, "Resource has been exhausted (e.g. check quota).", retry_delay="12s"),
         "rate_limited", True),
        (lambda: gemini_error(503, "The model is overloaded. Please try again later."), "model_unavailable", True),
        (lambda: gemini_error(500, "An internal error has occurred."), "model_unavailable", True),
        (lambda: gemini_error(403, "Permission denied on resource project."), "model_auth", False),
        (lambda: gemini_error(404, "models/gemini-9 is not found for API version v1beta"), "model_not_found", False),
        (lambda: gemini_error(400, "Function calling is not enabled for models/gemma-3-27b-it"), "model_error", False),
        (lambda: openai_error(429, "Rate limit reached for gpt-5 in organization org-x on tokens per min."),
         "rate_limited", True),
        (lambda: openai_error(500, "The server had an error while processing your request."),
         "model_unavailable", True),
        (lambda: openai_error(401, "Incorrect API key provided: sk-..."), "model_auth", False),
        (openai_timeout, "model_timeout", True),
        (anthropic_overloaded, "model_unavailable", True),  # HTTP 529: wait and retry, never "model error"
        (lambda: anthropic_error(429, "Number of request tokens has exceeded your per-minute rate limit"),
         "rate_limited", True),
        (lambda: anthropic_error(400, "messages.0.content: tool use is not supported"), "model_error", False),
    ],
)  # fmt: skip
def test_integration_errors_are_classified_and_retried_by_their_own_rules(
    make: Any, kind: str, retry: bool
) -> None:
    exc = make()
    assert isinstance(exc, ModelError)  # what the integration raises: LangChain's class over the SDK's
    assert classify(exc) == kind and retryable(exc, kind) is retry


def test_the_providers_x_should_retry_header_wins() -> None:
    no = openai_error(500, "The server had an error.", headers={"x-should-retry": "false"})
    yes = anthropic_error(400, "Please retry.", headers={"x-should-retry": "true"})
    assert classify(no) == "model_unavailable" and not retryable(no, "model_unavailable")
    assert classify(yes) == "model_error" and retryable(yes, "model_error")
    model = EventChatModel(events=[no, "never"])
    with pytest.raises(ModelCallError) as err:
        invoke_with_retries(model, "hi", FAST, sleep=lambda s: None)
    assert model.calls == 1 and err.value.attempts == 1


def test_a_langchain_model_error_of_an_unlisted_kind_says_itself_whether_to_retry() -> None:
    class Throttled(ModelError):
        is_retryable = True

    class Refused(ModelError):
        pass

    assert classify(Throttled("slow down")) == "model_unavailable"
    assert classify(Refused("no")) == "model_error"
    model = EventChatModel(events=[Throttled("slow down"), "fine"])
    invoke_with_retries(model, "hi", FAST, sleep=lambda s: None)
    assert model.calls == 2


@pytest.mark.parametrize(
    ("make", "seconds"),
    [
        (lambda: openai_error(429, "Rate limit", headers={"retry-after-ms": "1500", "retry-after": "2"}), 1.5),
        (lambda: anthropic_error(429, "Rate limit", headers={"retry-after": "7"}), 7.0),
        (lambda: anthropic_error(429, "Rate limit", headers={"Retry-After": http_date(30)}), 30.0),
        (lambda: anthropic_error(529, "Overloaded", headers={"retry-after-ms": "250"}), 0.25),
        (lambda: gemini_error(429, "Quota exceeded.", retry_delay="37s"), 37.0),
        (lambda: openai_error(429, "Rate limit reached. Please try again in 2.5s."), 2.5),
        (lambda: openai_error(429, "Limit 10000, Used 9000, Requested 1500. Please try again in 1m6.5s."), 66.5),
        (lambda: openai_error(429, "Please try again in 20ms."), 0.02),
    ],
    ids=["openai-retry-after-ms", "retry-after-seconds", "retry-after-http-date", "anthropic-529-ms",
         "gemini-retryinfo", "openai-message", "openai-minutes", "openai-ms"],
)  # fmt: skip
def test_the_providers_delay_in_every_form(make: Any, seconds: float) -> None:
    assert retry_delay_s(make()) == pytest.approx(seconds, abs=1.5)
    model = EventChatModel(events=[make(), "fine"])
    waits: list[float] = []
    invoke_with_retries(model, "hi", FAST, sleep=waits.append)
    assert waits == [pytest.approx(seconds, abs=1.5)]  # the provider's delay, not our 1 ms backoff


def test_retry_after_dates_in_the_past_and_garbage() -> None:
    assert parse_retry_after(http_date(-60)) == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(" 12 ") == 12.0


def test_a_delay_past_backoff_max_stops_as_rate_limited_and_says_when_to_resume() -> None:
    model = EventChatModel(events=[gemini_daily_quota(), "never"])
    waits: list[float] = []
    settings = CallSettings(max_retries=4, timeout_s=5.0, backoff_initial_s=0.001, backoff_max_s=120.0)
    before = time.time()
    with pytest.raises(ModelCallError) as err:
        invoke_with_retries(model, "hi", settings, sleep=waits.append)
    exc = err.value
    assert waits == [] and model.calls == 1 and exc.attempts == 1  # no 3,600 s sleep, no second call
    assert exc.kind == "rate_limited" and exc.transient  # resumable
    assert exc.retry_after_s == 3600.0 and exc.resume_after == pytest.approx(before + 3600, abs=5)
    assert "asks to wait 3600 s" in exc.detail and "120 s" in exc.detail


def test_backoff_never_exceeds_its_cap() -> None:
    settings = CallSettings(backoff_initial_s=2.0, backoff_max_s=5.0)
    assert all(model_calls.backoff_s(attempt, settings, None) <= 5.0 for attempt in range(10))
    assert model_calls.backoff_s(0, settings, 4.0) == 4.0


@pytest.mark.parametrize(
    ("failure", "retries"),
    [(gemini_error(429, "Quota exceeded.", retry_delay="0.001s"), 2), (openai_timeout(), 1),
     (anthropic_overloaded(), 0)],
    ids=["gemini-429", "openai-timeout", "anthropic-529"],
)  # fmt: skip
def test_attempts_are_exactly_one_plus_the_retries_asked_for(failure: BaseException, retries: int) -> None:
    model = EventChatModel(events=[failure] * 10)
    settings = CallSettings(max_retries=retries, timeout_s=5.0, backoff_initial_s=0.001, backoff_max_s=0.01)
    with pytest.raises(ModelCallError) as err:
        invoke_with_retries(model, "hi", settings, sleep=lambda s: None)
    assert model.calls == retries + 1 and err.value.attempts == retries + 1


def test_a_timed_out_request_is_cancelled_before_its_retry_is_sent() -> None:
    model = StallingChatModel(stalls=1, stall_s=30.0, reply="late but fine")
    settings = CallSettings(max_retries=1, timeout_s=0.3, backoff_initial_s=0.001, backoff_max_s=0.01)
    reply = invoke_with_retries(model, "hi", settings, sleep=lambda s: None)
    assert reply.content == "late but fine"
    assert model.events() == ["start", "cancelled", "start", "end"]  # never two requests in flight


COUNTING = threading.Lock()


class SyncStall(BaseChatModel):
    """A provider with no async client: its request runs in a thread no timeout can interrupt."""

    stall_s: float
    in_flight: int = 0
    most_in_flight: int = 0
    calls: int = 0

    @property
    def _llm_type(self) -> str:
        return "sync-stall"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with COUNTING:
            self.calls += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.calls == 1:
                time.sleep(self.stall_s)
            return ChatResult(generations=[ChatGeneration(message=AIMessage(content="fine"))])
        finally:
            with COUNTING:
                self.in_flight -= 1


def test_a_request_that_cannot_be_cancelled_is_waited_for_never_overlapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = CallSettings(max_retries=2, timeout_s=0.2, backoff_initial_s=0.001, backoff_max_s=0.01)
    # It ends soon after its timeout (as the SDK's own timeout makes it): the retry waits for it, then goes.
    ends = SyncStall(stall_s=0.6)
    assert invoke_with_retries(ends, "hi", settings, sleep=lambda s: None).content == "fine"
    assert ends.calls == 2 and ends.most_in_flight == 1

    # It hangs past the wait: no retry is sent on top of it; the failure says why.
    monkeypatch.setattr(model_calls, "ABANDON_WAIT_S", 0.3)
    hangs = SyncStall(stall_s=3.0)
    with pytest.raises(ModelCallError) as err:
        invoke_with_retries(hangs, "hi", settings, sleep=lambda s: None)
    assert err.value.kind == "model_timeout" and "could not be cancelled" in err.value.detail
    assert hangs.calls == 1 and err.value.attempts == 1


class WallGate:
    """A run with `left` seconds of wall-clock budget and nothing else to check."""

    def __init__(self, left: float) -> None:
        self.left = left

    def allow(self, messages: Any) -> float | None:
        return self.left

    def out_of_time(self) -> BudgetSpent:
        return BudgetSpent("wall-time budget spent (60 s)")


def test_only_a_call_cut_at_the_wall_deadline_is_the_wall_budget() -> None:
    settings = CallSettings(max_retries=2, timeout_s=300.0, backoff_initial_s=0.001, backoff_max_s=0.01)
    # The provider's own timeout, with the deadline far off: an ordinary retry.
    model = EventChatModel(events=[openai_timeout(), "fine"])
    invoke_with_retries(model, "hi", settings, sleep=lambda s: None, gate=WallGate(10.0))
    assert model.calls == 2
    # Our limit, shortened to the deadline, ended it: the wall-time budget, and no retry.
    stalls = StallingChatModel(stalls=3, stall_s=30.0)
    with pytest.raises(BudgetSpent, match="wall-time budget spent"):
        invoke_with_retries(stalls, "hi", settings, sleep=lambda s: None, gate=WallGate(0.3))
    assert stalls.events() == ["start", "cancelled"]
    # A backoff that would run past the deadline is not slept.
    waits: list[float] = []
    late = EventChatModel(events=[gemini_error(429, "Quota exceeded.", retry_delay="5s"), "fine"])
    slow = CallSettings(max_retries=2, timeout_s=300.0, backoff_initial_s=0.001, backoff_max_s=60.0)
    with pytest.raises(BudgetSpent):
        invoke_with_retries(late, "hi", slow, sleep=waits.append, gate=WallGate(2.0))
    assert waits == [] and late.calls == 1
