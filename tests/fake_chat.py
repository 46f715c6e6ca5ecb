"""A scripted chat model for tests: replies come from a list, in order, and every prompt is recorded.

langchain_core's fake chat models implement neither `bind_tools` nor `with_structured_output`; this one
does (tools are accepted and ignored; structured output parses the next scripted reply as JSON into the
schema), so authors that use either can be driven offline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
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

    def with_structured_output(self, schema: Any, **kwargs: Any) -> Any:
        def parse(messages: Any) -> Any:
            self.prompts.append(list(messages) if isinstance(messages, list) else [messages])
            data = json.loads(self._next())
            return schema.model_validate(data) if hasattr(schema, "model_validate") else data

        return RunnableLambda(parse)

    def stream_replies(self) -> Iterator[str]:
        yield from self.replies


class Killed(BaseException):  # noqa: N818 - it is what happened
    """Stands in for the process dying mid-call: not an Exception, so nothing on the way catches it."""


class RoutedChatModel(BaseChatModel):
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
