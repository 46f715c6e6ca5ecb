"""Terminal review of a paused (hitl) run: show the plan or code verbatim, then approve, edit in $EDITOR,
give feedback, stop, or leave the run paused.

Plans and kernels are full of `x_ref[i]`, `[pl.ds(0, 8)]` and `[/]`, which rich would read as markup: they
are printed with markup off (rich's Syntax for code on a terminal, plain `print` when piped, so nothing is
wrapped or styled). The answers are the same resume values the `--approve/--feedback/...` flags build.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from maxkernel.cli.root import console, out
from maxkernel.nodes.review import REVIEWS

# `maxkernel resume` option → how its help line shows it
_FLAG_TEXT = {
    "approve": "--approve",
    "plan_file": "--plan-file PLAN.md",
    "code_file": "--code-file KERNEL.py",
    "feedback": "--feedback TEXT",
    "stop": "--stop",
}
# kind → the flags that answer it without a terminal (from the review table's `cli` column)
REVIEW_FLAGS: dict[str, str] = {
    kind: " | ".join(
        _FLAG_TEXT[option] + (f" ({action})" if option == "approve" and action != "approve" else "")
        for option, (action, _) in point.cli.items()
    )
    for kind, point in REVIEWS.items()
}

# kind → key → (label, resume action, what the value carries: None / "edit" / "text")
REVIEW_CHOICES: dict[str, dict[str, tuple[str, str, str | None]]] = {
    "plan_review": {
        "a": ("approve", "approve", None),
        "e": ("edit the plan in $EDITOR", "replace", "edit"),
        "f": ("feedback (plan again)", "reject", "text"),
    },
    "code_review": {
        "a": ("approve", "approve", None),
        "e": ("edit the code in $EDITOR", "edit", "edit"),
        "f": ("feedback (write again)", "feedback", "text"),
    },
    "conversion_review": {
        "a": ("approve the JAX reference", "approve", None),
        "e": ("edit it in $EDITOR", "edit", "edit"),
        "f": ("feedback (the model writes it again)", "feedback", "text"),
        "s": ("stop the run", "stop", None),
    },
    "failure": {
        "r": ("retry the repair", "retry", None),
        "f": ("feedback for the repair", "feedback", "text"),
        "s": ("stop the run", "stop", None),
    },
}


def _edit_field(kind: str, action: str) -> str:
    """The resume field an edited body goes in: the one the review table's CLI option for `action` fills."""
    return next(field for act, field in REVIEWS[kind].cli.values() if act == action and field)


def stdin_is_terminal() -> bool:
    """A person at a terminal: stdin and stdout both ttys (a run whose output is captured, e.g. by a test or
    a script, never blocks on a prompt nobody sees)."""
    return sys.stdin.isatty() and sys.stdout.isatty()


def review_body(payload: dict[str, Any]) -> tuple[str, str]:
    """(body, language) of a pending review: the plan (markdown), the code (python) or the failure."""
    kind = payload.get("kind")
    if kind == "plan_review":
        return str(payload.get("plan") or ""), "markdown"
    if kind in ("code_review", "conversion_review"):
        return str(payload.get("code") or ""), "python"
    return f"stage {payload.get('stage')}: {payload.get('message') or ''}", "text"


def show_review(payload: dict[str, Any]) -> None:
    """Print what waits for review, verbatim (no markup), highlighted only on a terminal."""
    kind = payload.get("kind", "review")
    body, language = review_body(payload)
    console.print(f"\n[bold yellow]waiting for review[/]: {kind}, round {payload.get('iteration')}")
    if out.is_terminal and language == "python":
        from rich.syntax import Syntax

        out.print(Syntax(body, "python", line_numbers=True, word_wrap=False))
    elif out.is_terminal:
        out.print(body, markup=False, highlight=False, soft_wrap=True)
    else:
        print(body, flush=True)


def edit_in_editor(text: str, suffix: str) -> str:
    """Open `text` in $VISUAL/$EDITOR (vi when neither is set) and return what was saved."""
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    with tempfile.NamedTemporaryFile("w", suffix=suffix, delete=False) as f:
        f.write(text)
        path = f.name
    try:
        subprocess.run([*shlex.split(editor), path], check=True)
        with open(path) as f:
            return f.read()
    finally:
        os.unlink(path)


def interactive_review(
    payload: dict[str, Any],
    *,
    ask: Callable[[str], str] | None = None,
    edit: Callable[[str, str], str] = edit_in_editor,
) -> dict[str, Any] | None:
    """Show the review and ask until the person answers; the resume value, or None to leave it paused."""
    ask = ask or input  # looked up at call time (tests and embedders replace builtins.input)
    kind = str(payload.get("kind"))
    choices = REVIEW_CHOICES.get(kind)
    if choices is None:
        return None
    show_review(payload)
    menu = "  ".join(f"[{k}] {label}" for k, (label, _, _) in choices.items()) + "  [l] leave paused"
    while True:
        print(menu, flush=True)
        try:
            key = ask("choice> ").strip().lower()[:1]
        except EOFError:
            return None
        if key == "l":
            return None
        if key not in choices:
            print(f"unknown choice {key!r}", flush=True)
            continue
        _, action, carries = choices[key]
        if carries is None:
            return {"action": action}
        if carries == "edit":
            body, language = review_body(payload)
            edited = edit(body, ".py" if language == "python" else ".md")
            if not edited.strip() or edited == body:
                print("nothing changed; choose again", flush=True)
                continue
            return {"action": action, _edit_field(kind, action): edited}
        try:
            text = ask("feedback> ").strip()
        except EOFError:
            return None
        if text:
            return {"action": action, "feedback": text}
