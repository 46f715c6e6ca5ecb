"""Run settings that are not state: which model, which TPUs, where the store and run dirs are.

Passed to the graph with `context=Context(...)` (LangGraph's runtime context), never checkpointed: a resumed
run is given its settings again (the CLI keeps them in the store's `runs` table).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from maxkernel.tools.tpu_specs import DEFAULT_GENERATIONS, normalise_generations

OFFLINE_MODEL = "offline"
"""The `model` setting (and `--model`) that picks the offline author: the one place the word is compared."""


class AuthorKind(StrEnum):
    """Who writes the kernels of a run, decided once from `model` / `chat_model` (`Context.author_kind`)."""

    OFFLINE = OFFLINE_MODEL
    """The offline author: kernels synthesised from the reference's jaxpr, no model."""
    CHAT_MODEL = "chat_model"
    """A ready LangChain chat model object (the Python API, tests)."""
    MODEL = "model"
    """A model named by an init_chat_model string such as 'google_genai:gemini-2.5-pro'."""


def author_kind(model: str, chat_model: Any = None) -> AuthorKind:
    """The author a `model` string (and an optional chat model object, which wins) stands for."""
    if chat_model is not None:
        return AuthorKind.CHAT_MODEL
    return AuthorKind.OFFLINE if model == OFFLINE_MODEL else AuthorKind.MODEL


def default_model() -> str:
    """Gemini when a Google key is set, else the offline author: the first command works anywhere."""
    if os.environ.get("GOOGLE_API_KEY") or os.environ.get("GEMINI_API_KEY"):
        return "google_genai:gemini-2.5-pro"
    return OFFLINE_MODEL


@dataclass(kw_only=True)
class Context:
    """Built by the CLI, by Studio (from the assistant's configurable JSON) and by Python callers alike; the
    checks live in `__post_init__` so all three get them."""

    model: str = field(
        default_factory=default_model,
        metadata={
            "description": "'offline' or an init_chat_model string such as 'google_genai:gemini-2.5-pro'"
        },
    )
    tpu: list[str] = field(
        default_factory=lambda: list(DEFAULT_GENERATIONS),
        metadata={"description": "TPU generations every kernel must compile for"},
    )
    store_path: str = field(
        default=".maxkernel/results.db",
        metadata={"description": "results store: a SQLite file or a postgresql:// URL"},
    )
    work_dir: str = field(default=".maxkernel", metadata={"description": "sandbox run directories"})
    input_sets: int = field(default=3, metadata={"description": "input sets per configuration"})
    eval_timeout_s: float | None = field(
        default=None, metadata={"description": "limit for one evaluation; None: derived from the task"}
    )
    ray_address: str | None = field(
        default=None,
        metadata={
            "description": "run evaluations on Ray: 'auto' (an embedded local instance) or a cluster's "
            "HOST:PORT; None: in this process's sandboxed children (tools/cluster.py)"
        },
    )
    baseline: bool = field(
        default=True,
        metadata={
            "description": "start non-offline authors from the offline author's kernel when it has one"
        },
    )
    profile: bool = field(
        default=True,
        metadata={"description": "trace the best kernel each round (off for a one-shot synthesis)"},
    )
    chat_model: Any = field(
        default=None,
        metadata={"description": "a ready LangChain chat model (Python API, tests); overrides `model`"},
    )
    # --- budgets (also CLI flags and studio settings); None keeps the run's defaults (state.Budgets)
    max_model_calls: int | None = field(
        default=None, metadata={"description": "model calls at most (failed and re-asked calls count)"}
    )
    max_tokens: int | None = field(default=None, metadata={"description": "tokens at most, as reported"})
    max_wall_s: float | None = field(default=None, metadata={"description": "wall-clock seconds at most"})
    patience: int | None = field(
        default=None, metadata={"description": "stop after this many rounds without improvement"}
    )
    max_repairs: int | None = field(default=None, metadata={"description": "repairs per round at most"})
    # --- how model calls are made (authors.model_calls)
    model_retries: int = field(
        default=4,
        metadata={
            "description": "retries of a transient model failure (429, timeout, network, 5xx, 529); the only "
            "retries: neither the provider's SDK nor the graph retries on top of them"
        },
    )
    request_timeout_s: float = field(default=300.0, metadata={"description": "limit for one model call"})
    backoff_initial_s: float = field(
        default=2.0, metadata={"description": "first retry wait; doubles; the provider's retry delay wins"}
    )
    backoff_max_s: float = field(
        default=120.0,
        metadata={
            "description": "longest wait between retries; a provider asking for longer (a daily quota) ends "
            "the run as rate_limited, resumable, instead of sleeping"
        },
    )
    requests_per_second: float | None = field(
        default=None, metadata={"description": "client-side rate limit for model calls (None: no limit)"}
    )

    model_tools: int = field(
        default=4,
        metadata={"description": "tool calls (API look-up, draft check) per implement/repair step; 0: none"},
    )

    def call_settings(self) -> Any:
        from maxkernel.authors.model_calls import CallSettings

        return CallSettings(
            max_retries=self.model_retries,
            timeout_s=self.request_timeout_s,
            backoff_initial_s=self.backoff_initial_s,
            backoff_max_s=self.backoff_max_s,
            requests_per_second=self.requests_per_second,
        )

    def budget_overrides(self) -> dict[str, Any]:
        """The budgets this context sets, as `Budgets` field values (`max_repairs` is a state input field:
        `prepare` sets it on the state)."""
        names = ("max_model_calls", "max_tokens", "max_wall_s", "patience")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def author_kind(self) -> AuthorKind:
        """Who writes this run's kernels: what nodes and commands branch on, never the `model` string."""
        return author_kind(self.model, self.chat_model)

    @property
    def is_offline(self) -> bool:
        """The offline author writes the kernels (and only then do they get its sandbox allowances)."""
        return self.author_kind is AuthorKind.OFFLINE

    def __post_init__(self) -> None:
        # Canonical names ("trillium" -> "v6e"); an unknown one raises ValueError naming the valid ones.
        self.tpu = normalise_generations(self.tpu)
        if self.chat_model is not None and self.model == OFFLINE_MODEL:
            # A chat model object is a model author whatever `model` defaulted to: name it after the model,
            # so that results never say "offline" and nothing grants it the offline author's allowances.
            self.model = chat_model_name(self.chat_model)


def chat_model_name(chat_model: Any) -> str:
    """A readable name for a LangChain chat model object: its model id when it says, else its class."""
    for attr in ("model_name", "model", "model_id"):
        value = getattr(chat_model, attr, None)
        if isinstance(value, str) and value and value != OFFLINE_MODEL:
            return f"chat_model:{value}"
    return f"chat_model:{type(chat_model).__name__}"
