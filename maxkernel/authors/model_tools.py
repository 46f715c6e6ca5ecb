"""Tools the implementing model may call while it writes or repairs a kernel. The author binds them to the
model; the graph's tool node (`nodes.tool_node`) runs the calls and hands the answers back to the step.

- `lookup_pallas_api(name)`: the signature and docstring of a JAX / Pallas API from the *installed* JAX
  (`inspect`), so the model writes against the version the harness runs, not the one it remembers.
- `check_draft(source)`: a quick verdict on a draft from the harness (sandboxed child process: the draft is
  never imported here): one input set, the first target generation, no timing or estimate.

Every tool turn costs a model call (the reply that asked for it), so tool use is bounded by
`Context.model_tools` calls per step and by the run's model-call, token and wall-time budgets.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from langchain_core.tools import StructuredTool

# Short names a model uses → modules.
API_ALIASES: dict[str, str] = {
    "pl": "jax.experimental.pallas",
    "pltpu": "jax.experimental.pallas.tpu",
    "jnp": "jax.numpy",
    "lax": "jax.lax",
    "jax": "jax",
}
DOC_CHARS = 3000  # enough for a signature and its argument docs; a whole module docstring is not needed


def lookup_pallas_api(name: str) -> str:
    """Signature and docstring of a JAX/Pallas API, e.g. 'pl.BlockSpec', 'pltpu.CompilerParams',
    'pl.pallas_call', 'jax.lax.fori_loop', 'pltpu.VMEM'."""
    parts = name.strip().replace("()", "").split(".")
    head = API_ALIASES.get(parts[0], parts[0])
    obj: Any = None
    rest: list[str] = []
    for cut in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        module_name = ".".join([head, *parts[1:cut]])
        if not module_name.startswith("jax"):
            return f"only JAX and Pallas APIs can be looked up, not {name!r}"
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            continue
        rest = parts[cut:]
        break
    if obj is None:
        return f"no module found for {name!r}"
    for attr in rest:
        if not hasattr(obj, attr):
            near = sorted(a for a in dir(obj) if not a.startswith("_") and attr.lower() in a.lower())[:12]
            return f"{name}: no attribute {attr!r}" + (f"; similar: {', '.join(near)}" if near else "")
        obj = getattr(obj, attr)
    try:
        signature = f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        signature = f"{name} ({type(obj).__name__})"
    doc = inspect.getdoc(obj) or "(no docstring)"
    return f"{signature}\n\n{doc[:DOC_CHARS]}"


def make_check_draft(task: Any, tpu: list[str], work_dir: Path, store: Any = None) -> Any:
    """A `check_draft(source)` bound to one task: the harness's verdict on a draft, in its sandbox."""

    def check_draft(source: str) -> str:
        """Run the harness on a draft kernel module (whole module, exporting `computation`): compile,
        correctness on one input set, TPU compile for one generation. Returns the verdict and the error."""
        from maxkernel.tools.harness import EvalOptions, evaluate

        options = EvalOptions(tpu=tpu[:1], input_sets=1, timing=False, estimate=False, timeout_s=300)
        result = evaluate(task, source, options, store=store, work_dir=work_dir)
        if result.accepted:
            return "accepted: compiles, is correct on one input set and compiles for " + ", ".join(tpu[:1])
        if result.error is None:
            return "not accepted (no error message)"
        return f"failed at {result.error.stage}: {result.error.message[:1500]}"

    return check_draft


def tools_for(task: Any, tpu: list[str], work_dir: Path, store: Any = None) -> list[StructuredTool]:
    return [
        StructuredTool.from_function(lookup_pallas_api),
        StructuredTool.from_function(make_check_draft(task, tpu, work_dir, store)),
    ]
