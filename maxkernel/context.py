"""Run settings that are not state: which model, which TPUs, where the store and run dirs are.

Passed to the graph with `context=Context(...)` (LangGraph's runtime context), never checkpointed: a resumed
run is given its settings again (the CLI keeps them in the store's `runs` table).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from maxkernel.tools.tpu_specs import DEFAULT_GENERATIONS, normalise_generations


def default_model() -> str:
    """Gemini when a Google key is set, else the offline author: the first command works anywhere."""
    if os.environ.get("GOOGLE_API_KEY") or os.environ.get("GEMINI_API_KEY"):
        return "google_genai:gemini-2.5-pro"
    return "offline"


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
        default=".maxkernel/results.db", metadata={"description": "results store (SQLite)"}
    )
    work_dir: str = field(default=".maxkernel", metadata={"description": "sandbox run directories"})
    input_sets: int = field(default=3, metadata={"description": "input sets per configuration"})
    eval_timeout_s: float | None = field(
        default=None, metadata={"description": "limit for one evaluation; None: derived from the task"}
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

    def __post_init__(self) -> None:
        # Canonical names ("trillium" -> "v6e"); an unknown one raises ValueError naming the valid ones.
        self.tpu = normalise_generations(self.tpu)
