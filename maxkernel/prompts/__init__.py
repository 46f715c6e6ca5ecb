"""Prompt templates (markdown with `$name` placeholders) and the one function that fills them.

Templates hold no logic. `string.Template` keeps code samples' braces literal; a missing value is an error
(`substitute`), so a template and its caller cannot drift apart silently.
Code a template shows (the reference, a kernel, a harness message) arrives already fenced
(`authors.reply.fenced`): the fence is longer than any run of backticks in the code, which a fence written
into the template could not be.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from string import Template


@cache
def template(name: str) -> Template:
    text = resources.files(__package__).joinpath(f"{name}.md").read_text()
    return Template(text)


def render(name: str, **values: object) -> str:
    return template(name).substitute({k: "" if v is None else str(v) for k, v in values.items()})


def system_prompt(tpu_generations: list[str]) -> str:
    return render(
        "system",
        tpu_generations=", ".join(tpu_generations),
        pallas_guide=template("pallas_tpu_guide").template,
    )
