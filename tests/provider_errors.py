"""Provider failures exactly as the integrations raise them, with no network.

Each helper builds the provider SDK's own exception from an HTTP response carrying the status, headers and
JSON body the provider sends (google-genai reads the response itself; openai and anthropic take it in their
constructors, the way their clients build them), then passes it through the LangChain integration's own
conversion, which is what `ChatGoogleGenerativeAI` / `ChatOpenAI` / `ChatAnthropic` raise from `invoke`: a
`langchain_core.exceptions.ModelError` subclass that also inherits the SDK class and keeps the SDK error as
its cause (langchain-google-genai keeps the HTTP response only there).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import httpx2
import openai
from google.genai import errors as genai_errors
from langchain_anthropic.chat_models import _handle_anthropic_api_error, _handle_anthropic_bad_request
from langchain_google_genai.chat_models import _handle_client_error, _handle_server_error
from langchain_openai.chat_models.base import _handle_openai_api_error, _handle_openai_bad_request

GEMINI_URL = "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-pro:generateContent"
OPENAI_URL = "https://api.openai.com/v1/chat/completions"
ANTHROPIC_URL = "https://api.anthropic.com/v1/messages"


def _converted(convert: Any, error: BaseException, *args: Any) -> BaseException:
    """What the integration raises for `error` (its conversion always raises)."""
    try:
        convert(error, *args)
    except BaseException as raised:  # noqa: BLE001 - the conversion's result is the point
        return raised
    raise AssertionError(f"{convert.__name__} did not raise for {error!r}")


# --- Google (langchain-google-genai over google-genai) ------------------------------------------------------
GOOGLE_STATUS = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED",
                 500: "INTERNAL", 503: "UNAVAILABLE"}  # fmt: skip


def gemini_error(
    code: int, message: str, *, retry_delay: str | None = None, headers: dict[str, str] | None = None
) -> BaseException:
    """A Gemini API error: `{"error": {code, message, status, details}}`, RetryInfo when `retry_delay`."""
    details = (
        [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": retry_delay}]
        if retry_delay
        else []
    )
    body = {
        "error": {
            "code": code,
            "message": message,
            "status": GOOGLE_STATUS.get(code, "UNKNOWN"),
            "details": details,
        }
    }
    response = httpx.Response(
        code, json=body, headers=headers or {}, request=httpx.Request("POST", GEMINI_URL)
    )
    try:
        genai_errors.APIError.raise_for_response(response)
    except genai_errors.ClientError as error:
        return _converted(_handle_client_error, error, {"model": "models/gemini-2.5-pro"})
    except genai_errors.ServerError as error:
        return _converted(_handle_server_error, error)
    raise AssertionError(f"google-genai raised nothing for HTTP {code}")


def gemini_daily_quota() -> BaseException:
    return gemini_error(
        429,
        "You exceeded your current quota, please check your plan and billing details. Quota exceeded for "
        "metric: generativelanguage.googleapis.com/generate_requests_per_model_per_day, limit: 50",
        retry_delay="3600s",
    )


# --- OpenAI (langchain-openai over openai) ------------------------------------------------------------------
OPENAI_ERRORS: dict[int, type[openai.APIStatusError]] = {
    400: openai.BadRequestError,
    401: openai.AuthenticationError,
    404: openai.NotFoundError,
    429: openai.RateLimitError,
    500: openai.InternalServerError,
    503: openai.InternalServerError,
}


def openai_error(code: int, message: str, *, headers: dict[str, str] | None = None) -> BaseException:
    body = {"error": {"message": message, "type": "requests" if code == 429 else "invalid_request_error"}}
    response = httpx2.Response(
        code, json=body, headers=headers or {}, request=httpx2.Request("POST", OPENAI_URL)
    )
    error = OPENAI_ERRORS[code](f"Error code: {code} - {json.dumps(body)}", response=response, body=body)
    return _converted(_handle_openai_bad_request if code == 400 else _handle_openai_api_error, error)


def openai_timeout() -> BaseException:
    return _converted(_handle_openai_api_error, openai.APITimeoutError(httpx2.Request("POST", OPENAI_URL)))


# --- Anthropic (langchain-anthropic over anthropic) ---------------------------------------------------------
ANTHROPIC_ERRORS: dict[int, tuple[type[anthropic.APIStatusError], str]] = {
    400: (anthropic.BadRequestError, "invalid_request_error"),
    401: (anthropic.AuthenticationError, "authentication_error"),
    429: (anthropic.RateLimitError, "rate_limit_error"),
    500: (anthropic.InternalServerError, "api_error"),
    529: (anthropic.OverloadedError, "overloaded_error"),
}


def anthropic_error(code: int, message: str, *, headers: dict[str, str] | None = None) -> BaseException:
    cls, kind = ANTHROPIC_ERRORS[code]
    body = {"type": "error", "error": {"type": kind, "message": message}}
    response = httpx2.Response(
        code, json=body, headers=headers or {}, request=httpx2.Request("POST", ANTHROPIC_URL)
    )
    error = cls(f"Error code: {code} - {json.dumps(body)}", response=response, body=body)
    return _converted(_handle_anthropic_bad_request if code == 400 else _handle_anthropic_api_error, error)


def anthropic_overloaded() -> BaseException:
    return anthropic_error(529, "Overloaded")
