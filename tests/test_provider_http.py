"""The real integrations (`init_model("openai:...")`, `"anthropic:..."`, `"google_genai:..."`) against a
loopback server that answers as the providers do: the SDKs' own retries are off (the server counts every
request), the provider's delay reaches our backoff through the integration's exception, and a request that
times out is closed before its retry is sent."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from langchain_core.messages import HumanMessage

from maxkernel.authors.llm import init_model
from maxkernel.authors.model_calls import CallSettings, ModelCallError, invoke_with_retries

OPENAI_OK = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "gpt-4o-mini",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}  # fmt: skip
ANTHROPIC_OK = {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
    "content": [{"type": "text", "text": "fine"}], "stop_reason": "end_turn", "stop_sequence": None,
    "usage": {"input_tokens": 5, "output_tokens": 1},
}  # fmt: skip
GEMINI_OK = {
    "candidates": [{"content": {"role": "model", "parts": [{"text": "fine"}]}, "finishReason": "STOP", "index": 0}],
    "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 1, "totalTokenCount": 6},
    "modelVersion": "gemini-2.5-pro",
}  # fmt: skip


@dataclass
class Reply:
    status: int = 200
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    stall_s: float = 0.0


@dataclass
class Seen:
    path: str
    started: float
    closed_by_client: float | None = None


class Provider(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.script: list[Reply] = []
        self.seen: list[Seen] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Provider

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        seen = Seen(self.path, time.monotonic())
        self.server.seen.append(seen)
        reply = self.server.script.pop(0) if self.server.script else Reply(500, {"error": "script ran out"})
        end = time.monotonic() + reply.stall_s
        while time.monotonic() < end:  # a stalled provider: notice the client hanging up
            ready, _, _ = select.select([self.connection], [], [], 0.05)
            if ready and self.connection.recv(1, socket.MSG_PEEK) == b"":
                seen.closed_by_client = time.monotonic()
                return
        data = json.dumps(reply.body).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def provider(monkeypatch: pytest.MonkeyPatch) -> Iterator[Provider]:
    server = Provider()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for name, value in {
        "OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": server.url + "/v1",
        "ANTHROPIC_API_KEY": "sk-ant-test", "ANTHROPIC_BASE_URL": server.url,
        "GOOGLE_API_KEY": "test-key", "GOOGLE_GEMINI_BASE_URL": server.url,
        "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield server
    server.shutdown()
    server.server_close()


def gemini_429(delay: str) -> dict[str, Any]:
    return {"error": {"code": 429, "message": "Resource has been exhausted (e.g. check quota).",
                      "status": "RESOURCE_EXHAUSTED",
                      "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}]}}  # fmt: skip


CASES = {
    "openai-429-retry-after-ms": (
        "openai:gpt-4o-mini",
        Reply(429, {"error": {"message": "Rate limit reached", "type": "requests"}}, {"retry-after-ms": "1500"}),
        OPENAI_OK, 1.5,
    ),
    "anthropic-529-overloaded-retry-after": (
        "anthropic:claude-sonnet-4-5",
        Reply(529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
              {"retry-after": "4"}),
        ANTHROPIC_OK, 4.0,
    ),
    "gemini-429-retryinfo": ("google_genai:gemini-2.5-pro", Reply(429, gemini_429("2s")), GEMINI_OK, 2.0),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_provider_delay_reaches_our_backoff_and_the_sdk_does_not_retry(
    provider: Provider, case: str
) -> None:
    spec, failure, ok, delay = CASES[case]
    provider.script = [failure, Reply(200, ok)]
    settings = CallSettings(max_retries=2, timeout_s=20.0, backoff_initial_s=0.001, backoff_max_s=60.0)
    waits: list[float] = []
    reply = invoke_with_retries(
        init_model(spec, settings), [HumanMessage("hi")], settings, sleep=waits.append
    )
    assert "fine" in str(reply.content)
    assert len(provider.seen) == 2  # one failure, one retry: the SDK added none of its own
    assert waits == [pytest.approx(delay)]


def test_a_daily_quota_is_not_waited_for(provider: Provider) -> None:
    provider.script = [Reply(429, gemini_429("3600s")), Reply(200, GEMINI_OK)]
    settings = CallSettings(max_retries=4, timeout_s=20.0, backoff_initial_s=0.001, backoff_max_s=120.0)
    with pytest.raises(ModelCallError) as err:
        invoke_with_retries(init_model("google_genai:gemini-2.5-pro", settings), [HumanMessage("hi")], settings,
                            sleep=lambda s: pytest.fail("slept"))  # fmt: skip
    assert err.value.kind == "rate_limited" and err.value.retry_after_s == 3600 and len(provider.seen) == 1


@pytest.mark.parametrize(
    ("spec", "ok"),
    [("openai:gpt-4o-mini", OPENAI_OK), ("anthropic:claude-sonnet-4-5", ANTHROPIC_OK)],
    ids=["openai", "anthropic"],
)
def test_a_timed_out_request_is_closed_before_its_retry(provider: Provider, spec: str, ok: dict) -> None:
    # The SDK's own timeout is far away (as with an integration that takes none): only ours can end it.
    model = init_model(spec, CallSettings(timeout_s=60.0))
    settings = CallSettings(max_retries=1, timeout_s=3.0, backoff_initial_s=0.001, backoff_max_s=0.01)
    provider.script = [Reply(200, ok)]
    invoke_with_retries(model, [HumanMessage("warm up")], settings)  # the SDK's first-call set-up is slow
    provider.script = [Reply(200, ok, stall_s=30.0), Reply(200, ok)]
    start = time.monotonic()
    reply = invoke_with_retries(model, [HumanMessage("hi")], settings, sleep=lambda s: None)
    assert "fine" in str(reply.content) and time.monotonic() - start < 20
    _, stalled, retry = provider.seen
    assert stalled.closed_by_client is not None  # the provider saw the request go away...
    assert stalled.closed_by_client <= retry.started  # ...before the retry arrived: never two in flight
