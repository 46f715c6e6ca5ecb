"""The one reply parser: what a chat model said, whatever the provider's message shape.

Providers disagree on everything a reply carries. Gemini 3 returns content blocks with `thinking` parts and
opaque `signature`s next to the text; Anthropic returns `text` / `thinking` / `tool_use` blocks; OpenAI
returns a plain string (reasoning models put their reasoning in `additional_kwargs`/`reasoning` blocks).
Finish reasons are spelt `MAX_TOKENS` (Gemini), `max_tokens` (Anthropic) or `length` (OpenAI). Everything
here turns a message into a `ParsedReply` so the author never looks at a provider's shape, and the kernel
module is picked out of the text by one rule set, tested on those shapes (tests/test_reply.py).
"""

from __future__ import annotations

import ast
import builtins
import re
from typing import Any

from pydantic import BaseModel, Field

# Finish reasons that mean "the token limit cut the reply short", lower-cased.
TRUNCATION_REASONS = frozenset({"max_tokens", "length", "max_output_tokens", "finish_reason_max_tokens"})

# Content block types that carry the model's thinking, never its answer.
THINKING_TYPES = frozenset({"thinking", "reasoning", "redacted_thinking"})

# An opening fence: ``` or ~~~ (3 or more), an optional info string (python, Python, py, python3, ...).
_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
_PYTHON_INFOS = frozenset({"", "python", "py", "python3", "py3", "pycon", "ipython", "python 3"})


class ParsedReply(BaseModel):
    """A model reply reduced to what maxkernel uses."""

    text: str = Field("", description="the answer: text blocks joined; thinking excluded")
    thinking: str = Field("", description="thinking/reasoning blocks joined (never parsed for code)")
    finish_reason: str | None = None
    truncated: bool = Field(False, description="the provider stopped the reply at its token limit")
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None

    @property
    def thinking_only(self) -> bool:
        return not self.text.strip() and bool(self.thinking.strip())


def parse_message(message: Any) -> ParsedReply:
    """A LangChain message (AIMessage or anything with `.content`) → `ParsedReply`."""
    content = getattr(message, "content", message)
    text, thinking = split_content(content)
    extra = getattr(message, "additional_kwargs", None) or {}
    if isinstance(extra.get("reasoning_content"), str):  # DeepSeek / OpenAI-compatible servers
        thinking = (thinking + "\n" + extra["reasoning_content"]).strip()
    reason = finish_reason_of(message)
    usage = usage_of_message(message)
    return ParsedReply(
        text=text,
        thinking=thinking,
        finish_reason=reason,
        truncated=bool(reason and reason.lower() in TRUNCATION_REASONS),
        **usage,
    )


def split_content(content: Any) -> tuple[str, str]:
    """(answer text, thinking text) of a message's content: a string or a list of content blocks."""
    if content is None:
        return "", ""
    if isinstance(content, str):
        return content, ""
    texts: list[str] = []
    thoughts: list[str] = []
    for block in content if isinstance(content, list) else [content]:
        if isinstance(block, str):
            texts.append(block)
            continue
        if not isinstance(block, dict):
            continue
        kind = str(block.get("type", "text"))
        if kind in THINKING_TYPES or block.get("thought") is True:
            # Gemini: {"type": "thinking", "thinking": ..., "signature": ...}; Anthropic the same keys;
            # OpenAI responses API: {"type": "reasoning", "summary": [{"text": ...}]}.
            body = block.get("thinking") or block.get("reasoning") or block.get("text") or ""
            if not body and isinstance(block.get("summary"), list):
                body = "\n".join(str(s.get("text", "")) for s in block["summary"] if isinstance(s, dict))
            thoughts.append(str(body))
        elif kind in ("text", "output_text"):
            texts.append(str(block.get("text", "")))
        # tool_use / function_call / image blocks carry no answer text
    return "".join(texts), "\n".join(t for t in thoughts if t)


def finish_reason_of(message: Any) -> str | None:
    meta = getattr(message, "response_metadata", None) or {}
    for key in ("finish_reason", "stop_reason", "done_reason"):
        value = meta.get(key)
        if value:
            return str(getattr(value, "name", value))  # Gemini may hand back an enum
    return None


def usage_of_message(message: Any) -> dict[str, int | None]:
    """Token counts as the provider reported them (None where it reported nothing)."""
    meta = getattr(message, "usage_metadata", None) or {}
    if not meta:
        raw = (getattr(message, "response_metadata", None) or {}).get("token_usage") or {}
        meta = {
            "input_tokens": raw.get("prompt_tokens"),
            "output_tokens": raw.get("completion_tokens"),
            "total_tokens": raw.get("total_tokens"),
        }
    inp, outp, total = meta.get("input_tokens"), meta.get("output_tokens"), meta.get("total_tokens")
    if total is None and (inp is not None or outp is not None):
        total = int(inp or 0) + int(outp or 0)
    return {"input_tokens": inp, "output_tokens": outp, "total_tokens": total}


# --- code blocks ---------------------------------------------------------------------------------------
class CodeBlock(BaseModel):
    info: str
    code: str
    closed: bool = Field(True, description="False when the reply ended inside the block (truncation)")


def code_blocks(text: str) -> list[CodeBlock]:
    """Fenced blocks in order: ``` or ~~~ of any length, any info string; a closing fence must use the
    same character and be at least as long (CommonMark). An unclosed last block is returned, marked."""
    blocks: list[CodeBlock] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").strip().lower()
        closer = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body: list[str] = []
        i += 1
        closed = False
        while i < len(lines):
            if closer.match(lines[i]):
                closed = True
                break
            body.append(lines[i])
            i += 1
        blocks.append(CodeBlock(info=info, code="\n".join(body).strip("\n") + "\n", closed=closed))
        i += 1
    return blocks


def _defines_computation(code: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return bool(re.search(r"^def computation\s*\(", code, re.MULTILINE))
    return any(
        isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == "computation" for n in tree.body
    ) or any(
        isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "computation" for t in n.targets)
        for n in tree.body
    )


def _python(block: CodeBlock) -> bool:
    return block.info.split()[0] in _PYTHON_INFOS if block.info else True


def _score(block: CodeBlock, index: int) -> tuple[int, int, int, int, int]:
    python = _python(block)
    return (
        int(_defines_computation(block.code)),
        int("pallas_call" in block.code),
        int(block.closed),
        int(python),
        index,  # later wins a tie: a corrected module usually follows the first try
    )


def unfenced_module(text: str) -> str | None:
    """A module written without fences, with prose before/after: the longest run of lines, starting at an
    import/def/decorator/comment, that parses as Python and defines `computation`."""
    lines = text.splitlines()
    starts = [
        i
        for i, ln in enumerate(lines)
        if re.match(r"^(import |from \S+ import |def |@|#|\"\"\"|'''|[A-Z_]+\s*=)", ln)
    ]
    for start in starts:
        for end in range(len(lines), start, -1):
            chunk = "\n".join(lines[start:end]).strip() + "\n"
            if "def computation" not in chunk:
                break
            try:
                ast.parse(chunk)
            except SyntaxError:
                continue
            if _defines_computation(chunk):
                return chunk
    return None


class NoModule(ValueError):
    """The reply holds no kernel module; `reason` says what it holds instead, for the model to hear."""


def _bound_and_loaded(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound anywhere in the module, names read anywhere): enough to tell a module that is missing
    its imports or helpers from one that has them (scopes are not told apart; a name bound in any scope
    counts as bound)."""
    bound: set[str] = set()
    loaded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.Global | ast.Nonlocal):
            bound.update(node.names)
    return bound, loaded


def missing_names(code: str) -> set[str]:
    """Names `code` reads but never binds or imports (builtins excepted); empty when it does not parse."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    bound, loaded = _bound_and_loaded(tree)
    return {n for n in loaded - bound if not hasattr(builtins, n)} - {"__file__"}


_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
                ast.AnnAssign)  # fmt: skip


def _only_definitions(code: str) -> bool:
    """Whether a block only defines things (imports, functions, classes, constants, a docstring): a usage
    example that calls the kernel at top level must not be pasted into the module."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return all(
        isinstance(n, _DEFINITIONS) or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        for n in tree.body
    )


def assembled_module(blocks: list[CodeBlock], best: CodeBlock) -> str | None:
    """The module a reply spreads over several blocks (imports and `_kernel` in one, `computation` in the
    next): the closed python blocks that only define things, in reply order, up to and including `best`.
    None unless the assembly parses, defines `computation` and reads fewer undefined names than `best`."""
    upto = blocks.index(best)
    parts = [b.code for b in blocks[: upto + 1] if b.closed and _python(b) and _only_definitions(b.code)]
    if best.code not in parts:
        return None
    code = "\n\n".join(part.rstrip("\n") for part in parts) + "\n"
    if not _defines_computation(code) or len(missing_names(code)) >= len(missing_names(best.code)):
        return None
    return code


def extract_module(text: str) -> str:
    """The kernel module in a reply: among fenced blocks, the one that defines `computation` and calls
    `pallas_call` (closed, python-tagged, later breaking ties); when that block reads names it never
    defines (its imports and kernel are in an earlier block), the module assembled from the reply's
    blocks; else an unfenced module amid prose."""
    blocks = code_blocks(text)
    if blocks:
        scored = sorted(((_score(b, i), b) for i, b in enumerate(blocks)), key=lambda x: x[0])
        best_score, best = scored[-1]
        if best_score[0]:
            if missing_names(best.code):
                return assembled_module(blocks, best) or best.code
            return best.code
    found = unfenced_module(text)
    if found is not None:
        return found
    if blocks:
        raise NoModule(
            f"the reply has {len(blocks)} code block(s) but none defines `computation`: "
            "reply with the whole module in one ```python block"
        )
    raise NoModule("the reply has no code: reply with the whole module in one ```python block")


def fenced(text: str, info: str = "") -> str:
    """`text` in a Markdown code fence longer than any run of backticks inside it (CommonMark closes a fence
    only on a run at least as long), so a ``` in a kernel's docstring cannot end the block early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text.rstrip(chr(10))}\n{fence}"


def extract_json_object(text: str) -> str | None:
    """The first balanced {...} in a reply (fenced ```json or bare), for models without structured output."""
    for block in code_blocks(text):
        if block.code.lstrip().startswith("{"):
            return block.code
    start = text.find("{")
    while start >= 0:
        depth, in_str, esc = 0, False, False
        for j in range(start, len(text)):
            ch = text[j]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
                continue
            if ch == '"':
                in_str = True
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start : j + 1]
        start = text.find("{", start + 1)
    return None
