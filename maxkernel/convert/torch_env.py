"""Import PyTorch and torchax (only ever inside a sandboxed conversion child: PyTorch code is task code).

torchax 0.0.13 (the newest release) names PyTorch's named-tensor overloads (`aten.prod.dim_Dimname`, 20
more) in its autocast table and decomposition list; PyTorch 2.13 removed named tensors, so the plain import
fails (google/torchax issue 101, fixed on torchax's main branch after that release). While torchax loads
and builds its environment, a missing overload whose name marks it as a named-tensor one resolves to an
inert placeholder: those entries are table keys for ops PyTorch 2.13 can no longer produce, so nothing
ever looks them up. Any other missing overload still raises. With a torchax that no longer names them, the
placeholder is never used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

NAMED_TENSOR_MARKERS = ("dimname", "names")
"""Substrings of the (lower-cased) overload names PyTorch 2.13 removed with named tensors."""


class RemovedOverload:
    """Stands for an ATen overload this PyTorch no longer has; hashable, never callable."""

    def __init__(self, qualified: str) -> None:
        self.qualified = qualified

    def __repr__(self) -> str:
        return f"<removed overload {self.qualified}>"


@contextlib.contextmanager
def named_tensor_overloads_tolerated() -> Iterator[list[str]]:
    """Within the block, `torch.ops.aten.<op>.<named-tensor overload>` gives a `RemovedOverload` instead
    of raising; yields the list of names that were stood in for."""
    import torch._ops as ops

    original = ops.OpOverloadPacket.__getattr__
    stood_in: list[str] = []

    def lookup(self: Any, key: str) -> Any:
        try:
            return original(self, key)
        except AttributeError:
            if any(m in key.lower() for m in NAMED_TENSOR_MARKERS):
                name = f"{self._qualified_op_name}.{key}"
                stood_in.append(name)
                return RemovedOverload(name)
            raise

    ops.OpOverloadPacket.__getattr__ = lookup  # type: ignore[method-assign]
    try:
        yield stood_in
    finally:
        ops.OpOverloadPacket.__getattr__ = original  # type: ignore[method-assign]


_ENV: Any = None


def torchax_env() -> Any:
    """torchax's default environment (imported and built once per process)."""
    global _ENV
    if _ENV is None:
        with named_tensor_overloads_tolerated():
            import torchax

            _ENV = torchax.default_env()
    return _ENV


def versions() -> dict[str, str]:
    import jax
    import torch

    torchax_env()
    import torchax

    return {"torch": torch.__version__, "torchax": torchax.__version__, "jax": jax.__version__}
