"""A scripted chat model for tests: replies come from a list, in order, and every prompt is recorded.

langchain_core's fake chat models implement neither `bind_tools` nor `with_structured_output`; this one
does (tools are accepted and ignored; structured output parses the next scripted reply as JSON into the
schema), so authors that use either can be driven offline.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableLambda
from pydantic import Field


class ScriptedChatModel(BaseChatModel):
    replies: list[str]
    prompts: list[list[BaseMessage]] = Field(default_factory=list)
    position: int = 0

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _next(self) -> str:
        if self.position >= len(self.replies):
            raise RuntimeError(f"scripted model ran out of replies after {self.position}")
        text = self.replies[self.position]
        self.position += 1
        return text

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.prompts.append(list(messages))
        text = self._next()
        usage = {"input_tokens": 100, "output_tokens": len(text) // 4, "total_tokens": 100 + len(text) // 4}
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text, usage_metadata=usage))])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedChatModel:
        return self

    def with_structured_output(self, schema: Any, *, include_raw: bool = False, **kwargs: Any) -> Any:
        """As LangChain's: with `include_raw`, {"raw", "parsed", "parsing_error"} and a parse failure is
        reported there, not raised."""

        def parse(messages: Any) -> Any:
            self.prompts.append(list(messages) if isinstance(messages, list) else [messages])
            text = self._next()
            return structured_result(AIMessage(content=text), schema, include_raw)

        return RunnableLambda(parse)

    def stream_replies(self) -> Iterator[str]:
        yield from self.replies


def structured_result(message: AIMessage, schema: Any, include_raw: bool) -> Any:
    """What `with_structured_output` returns for `message`: the parsed schema (a parse error raises), or
    with `include_raw` the {"raw", "parsed", "parsing_error"} dict LangChain returns."""
    from maxkernel.authors.reply import parse_message

    try:
        data = json.loads(parse_message(message).text)
        parsed, error = (schema.model_validate(data) if hasattr(schema, "model_validate") else data), None
    except ValueError as exc:
        if not include_raw:
            raise
        parsed, error = None, exc
    return {"raw": message, "parsed": parsed, "parsing_error": error} if include_raw else parsed


class Killed(BaseException):  # noqa: N818 - it is what happened
    """Stands in for the process dying mid-call: not an Exception, so nothing on the way catches it."""


class SyncPath:
    """`ainvoke` through `invoke` in a worker thread, as a provider without a native async client runs.

    The author calls models with `ainvoke` (so a timeout can cancel the request). LangChain's async
    generation path reads `.generations` off any BaseException that is not an Exception, which would turn the
    `Killed` stand-in into an AttributeError; a kill must reach the caller as itself."""

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.invoke, input, config, **kwargs)  # type: ignore[attr-defined]


class RoutedChatModel(SyncPath, BaseChatModel):
    """Replies chosen by what the prompt asks for (first matching substring wins), so concurrent branches
    of a search get the right kind of reply whatever order they run in."""

    rules: list[tuple[str, str]]
    calls: int = 0
    prompts: list[str] = Field(default_factory=list)
    kill_once_on: str | None = Field(None, description="raise Killed the first time a prompt contains this")

    @property
    def _llm_type(self) -> str:
        return "routed"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prompt = str(messages[-1].content)
        if self.kill_once_on and self.kill_once_on in prompt:
            self.kill_once_on = None
            raise Killed(f"simulated kill while answering a prompt with {prompt[:60]!r}")
        self.calls += 1
        self.prompts.append(prompt)
        for needle, reply in self.rules:
            if needle in prompt:
                return ChatResult(generations=[ChatGeneration(message=AIMessage(content=reply))])
        raise RuntimeError(f"no scripted rule matches the prompt: {prompt[:200]!r}")


# --- realistic reply shapes and failures ---------------------------------------------------------------
KERNEL = (Path(__file__).parent / "data" / "candidates" / "llm_correct.py").read_text()


def _usage(text: str, prompt_tokens: int = 1200) -> dict[str, int]:
    out = max(1, len(text) // 4)
    return {"input_tokens": prompt_tokens, "output_tokens": out, "total_tokens": prompt_tokens + out}


def gemini3_message(text: str, finish_reason: str = "STOP") -> AIMessage:
    """langchain-google-genai with a Gemini 3 model: thinking part with a signature, then the text."""
    return AIMessage(
        content=[
            {"type": "thinking", "thinking": "THOUGHT: tile M and N by 128.", "signature": "CpYBAbT3..."},
            {"type": "text", "text": text, "extras": {"signature": "EpwB..."}},
        ],
        response_metadata={"finish_reason": finish_reason, "model_name": "gemini-3-pro-preview"},
        usage_metadata={**_usage(text), "output_token_details": {"reasoning": 40}},
    )


def anthropic_message(text: str, stop_reason: str = "end_turn") -> AIMessage:
    return AIMessage(
        content=[
            {"type": "thinking", "thinking": "THOUGHT: the bias broadcasts.", "signature": "ErUB..."},
            {"type": "text", "text": text},
        ],
        response_metadata={"stop_reason": stop_reason, "model": "claude-sonnet-4-5"},
        usage_metadata=_usage(text),
    )


def openai_message(text: str, finish_reason: str = "stop") -> AIMessage:
    """Chat Completions: a plain string, usage under response_metadata['token_usage'] only."""
    u = _usage(text)
    return AIMessage(
        content=text,
        response_metadata={
            "finish_reason": finish_reason,
            "token_usage": {
                "prompt_tokens": u["input_tokens"],
                "completion_tokens": u["output_tokens"],
                "total_tokens": u["total_tokens"],
            },
        },
    )


def openai_reasoning_message(text: str) -> AIMessage:
    """Responses API with reasoning summaries."""
    return AIMessage(
        content=[
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "THOUGHT: k innermost."}]},
            {"type": "text", "text": text},
        ],
        response_metadata={"finish_reason": "stop"},
        usage_metadata=_usage(text),
    )


class ProviderError(Exception):
    """Shaped like google.genai.errors.APIError / openai.APIStatusError: a `code`/`status_code`, a message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code} {message}")
        self.code = code
        self.status_code = code


def gemini_429(delay: str = "0.01s") -> ProviderError:
    return ProviderError(
        429,
        "RESOURCE_EXHAUSTED. {'error': {'code': 429, 'message': 'You exceeded your current quota.', "
        "'status': 'RESOURCE_EXHAUSTED', 'details': [{'@type': 'type.googleapis.com/google.rpc.RetryInfo', "
        f"'retryDelay': '{delay}'}}]}}}}",
    )


class EventChatModel(SyncPath, BaseChatModel):
    """Plays `events` in order: an Exception is raised, a message is returned, a str becomes a Gemini 3
    message. No structured output unless `structured` (then a JSON string event is parsed into the schema).
    Counts calls and the tokens the returned messages report."""

    events: list[Any]
    structured: bool = False
    calls: int = 0
    reported_tokens: int = 0
    prompts: list[str] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "events"

    def _event(self, prompt: str) -> Any:
        self.calls += 1
        self.prompts.append(prompt)
        if not self.events:
            raise RuntimeError("the event script ran out")
        event = self.events.pop(0)
        if isinstance(event, BaseException):
            raise event
        return event

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        msg = self._event(str(messages[-1].content))
        msg = gemini3_message(msg) if isinstance(msg, str) else msg
        if msg.usage_metadata:
            self.reported_tokens += msg.usage_metadata["total_tokens"]
        return ChatResult(generations=[ChatGeneration(message=msg)])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> EventChatModel:
        return self

    def with_structured_output(self, schema: Any, *, include_raw: bool = False, **kwargs: Any) -> Any:
        if not self.structured:
            raise NotImplementedError("this fake provider has no structured output")

        def parse(messages: Any) -> Any:
            event = self._event(str(messages[-1].content))
            msg = gemini3_message(event) if isinstance(event, str) else event
            if msg.usage_metadata:
                self.reported_tokens += msg.usage_metadata["total_tokens"]
            return structured_result(msg, schema, include_raw)

        return RunnableLambda(parse)


class StallingChatModel(BaseChatModel):
    """A provider with a native async client whose first `stalls` requests hang for `stall_s` seconds before
    answering; later ones answer `reply` at once. `log` records (time.monotonic(), event) for every request:
    "start", "cancelled" (the caller gave up and the request was closed), "end". A request a timeout
    abandoned instead of cancelling shows as a "start" with no "cancelled" before the next "start"."""

    reply: str = "# Plan\nTiled matmul."
    stalls: int = 1
    stall_s: float = 5.0
    log: list[tuple[float, str]] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "stalling"

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:  # fmt: skip
        raise NotImplementedError("this fake provider answers through its async client only")

    async def _agenerate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                         **kwargs: Any) -> ChatResult:  # fmt: skip
        import time

        self.log.append((time.monotonic(), "start"))
        stalled = sum(event == "start" for _, event in self.log) <= self.stalls
        try:
            if stalled:
                await asyncio.sleep(self.stall_s)
        except asyncio.CancelledError:
            self.log.append((time.monotonic(), "cancelled"))
            raise
        self.log.append((time.monotonic(), "end"))
        usage = {"input_tokens": 100, "output_tokens": 10, "total_tokens": 110}
        return ChatResult(
            generations=[ChatGeneration(message=AIMessage(content=self.reply, usage_metadata=usage))]
        )

    def events(self) -> list[str]:
        return [event for _, event in self.log]


class ToolShyChatModel(EventChatModel):
    """A model without tool or JSON-mode support behind a tool-capable API (Gemma behind the Gemini API, a
    local model behind an OpenAI-compatible server): `bind_tools` and `with_structured_output` succeed, and
    the call then fails with the provider's HTTP 400 (`refusal`, as the integration raises it). Plain calls
    play `events`. `kinds` records each request: "tools", "structured" or "plain"."""

    refusal: Any = None
    refuse_plain: bool = False
    kinds: list[str] = Field(default_factory=list)

    def _event(self, prompt: str) -> Any:
        self.kinds.append("plain")
        if self.refuse_plain:
            self.calls += 1
            raise self.refusal
        return super()._event(prompt)

    def _refused(self, kind: str) -> Any:
        def call(messages: Any) -> Any:
            self.calls += 1
            self.kinds.append(kind)
            raise self.refusal

        return RunnableLambda(call)

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:  # type: ignore[override]
        return self._refused("tools")

    def with_structured_output(self, schema: Any, *, include_raw: bool = False, **kwargs: Any) -> Any:
        return self._refused("structured")
