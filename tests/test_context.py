"""The run context: who writes the kernels is one typed decision (`Context.author_kind`), made from `model`
and `chat_model` in one place, that nodes, the CLI and the bench read instead of comparing strings."""

from __future__ import annotations

from pathlib import Path

from maxkernel.bench import Bench, BenchSettings
from maxkernel.context import OFFLINE_MODEL, AuthorKind, Context, author_kind


class _NamedModel:
    model_name = "tiny-model"


def test_author_kind_is_decided_once_from_model_and_chat_model() -> None:
    assert Context(model=OFFLINE_MODEL).author_kind is AuthorKind.OFFLINE
    assert Context(model="google_genai:gemini-2.5-pro").author_kind is AuthorKind.MODEL
    # a chat model object wins over a defaulted 'offline' and is named after the model
    ctx = Context(model=OFFLINE_MODEL, chat_model=_NamedModel())
    assert ctx.author_kind is AuthorKind.CHAT_MODEL and not ctx.is_offline
    assert ctx.model == "chat_model:tiny-model"
    assert author_kind("offline") is AuthorKind.OFFLINE and author_kind("openai:gpt-x") is AuthorKind.MODEL


def test_only_the_offline_author_skips_the_bench_profile(tmp_path: Path) -> None:
    def flags(model: str) -> list[str]:
        settings = BenchSettings(suite=str(tmp_path), out_dir=str(tmp_path / "out"), model=model)
        return Bench(settings)._no_profile()

    assert flags(OFFLINE_MODEL) == ["--no-profile"]
    assert flags("google_genai:gemini-2.5-pro") == []
