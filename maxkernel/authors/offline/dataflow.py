"""The flat jaxpr as a data-flow graph: what each primitive is, who produces and who consumes each value.

Primitives fall into five kinds, and the partitioner treats each kind differently:

* **elementwise**: same-shape n-ary maps (scalar literals allowed). Re-emitted inside kernels.
* **absorbed**: layout changes a kernel can see through without moving data (convert, broadcast,
  transpose, reshapes that only add or drop unit dims, iota). Inside a kernel they are aliases or casts.
* **reduce**: reductions along some axes (sum, max, min, argmax, ...).
* **dot**: `dot_general`.
* **glue**: real layout ops (reshapes that split or merge dims, slices, pads, concatenation, gathers).
  They stay outside `pallas_call` as plain XLA, which the harness allows.
* a template family's own kind (`families.EQUATION_KINDS`: a grouped matmul, a scan with a carry).

Anything else (sorts, scatters, FFTs, ...) is unsupported. The catalogs live in `maxkernel.tools.jaxpr`,
next to the harness's and the estimator's (which differ on purpose; each says why).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from jax.extend import core as jcore

from maxkernel.authors.offline.families import EQUATION_KINDS
from maxkernel.authors.offline.trace import Traces, Unsupported
from maxkernel.tools.jaxpr import ABSORBED, DOT, ELEMENTWISE, GLUE, RANDOM, REDUCE

UNSUPPORTED_HINTS = {
    "sort": "a sort (lax.sort / argsort / top_k)",
    "cumsum": "a cumulative sum",
    "cumprod": "a cumulative product",
    "cummax": "a cumulative max",
    "cumlogsumexp": "a cumulative logsumexp",
    "scan": "a scan with a carried state (lax.scan / fori_loop)",
    "while": "a while loop (lax.while_loop, searchsorted, fori_loop)",
    "cond": "data-dependent control flow (lax.cond / switch)",
    "scatter": "a scatter (x.at[...].set)",
    "scatter-add": "a scatter-add (x.at[...].add, bincount, segment_sum)",
    "scatter_add": "a scatter-add (x.at[...].add, bincount, segment_sum)",
    "fft": "an FFT",
    "conv_general_dilated": "a convolution",
    "ragged_dot": "a ragged (grouped) matmul (lax.ragged_dot)",
    "reduce_prod": "a product reduction",
    "random_bits": "random number generation",
    "threefry2x32": "random number generation",
    "reduce_window_sum": "a windowed reduction (pooling)",
    "reduce_window_max": "a windowed reduction (pooling)",
    "reduce_window": "a windowed reduction (pooling)",
    "custom_linear_solve": "a linear solve",
    "triangular_solve": "a triangular solve",
    "cholesky": "a Cholesky factorisation",
    "eigh": "an eigendecomposition",
    "svd": "an SVD",
    "qr": "a QR factorisation",
}


def reduced_axes(eqn: Any) -> tuple[int, ...]:
    """The operand dims a reduction (or `top_k`, which reduces its last axis to k winners) runs along."""
    if eqn.primitive.name == "top_k":
        axis = eqn.params.get("axis", len(eqn.invars[0].aval.shape) - 1)
        return (int(axis) % len(eqn.invars[0].aval.shape),)
    return tuple(int(a) for a in eqn.params["axes"])


def _same_width_bitcast(eqn: Any) -> bool:
    """A bitcast between types of one width (random bits turned into floats) maps element to element; a
    kernel re-emits it. Bitcasts that change the width change the shape and stay layout glue."""
    if eqn.primitive.name != "bitcast_convert_type":
        return False
    src, dst = eqn.invars[0].aval, eqn.outvars[0].aval
    return src.dtype.itemsize == dst.dtype.itemsize and tuple(src.shape) == tuple(dst.shape)


def is_literal(v: Any) -> bool:
    return isinstance(v, jcore.Literal)


def is_unit_reshape(eqn: Any, traces: Traces) -> bool:
    """A reshape that only inserts or removes dims of size 1 (in every configuration)."""
    if eqn.primitive.name in ("squeeze", "expand_dims"):
        return True
    if eqn.primitive.name != "reshape":
        return False
    src, dst = eqn.invars[0], eqn.outvars[0]
    if any(is_literal(v) for v in (src,)):
        return False
    a = [tuple(s[d] for d in range(len(s)) if not traces.unit(src, d)) for s in traces.shapes(src)]
    b = [tuple(s[d] for d in range(len(s)) if not traces.unit(dst, d)) for s in traces.shapes(dst)]
    return a == b


class Graph:
    """Producers and consumers of every var in the primary trace, and each equation's kind."""

    def __init__(self, traces: Traces) -> None:
        self.traces = traces
        self.jaxpr = traces.primary.jaxpr
        self.eqns: list[Any] = list(self.jaxpr.eqns)
        self.producer: dict[Any, int] = {}
        self.consumers: dict[Any, list[int]] = defaultdict(list)
        for i, e in enumerate(self.eqns):
            for v in e.outvars:
                self.producer[v] = i
            for v in e.invars:
                if not is_literal(v):
                    self.consumers[v].append(i)
        self.outvars = [v for v in self.jaxpr.outvars]
        self.out_set = {v for v in self.outvars if not is_literal(v)}
        self.invars = list(self.jaxpr.invars)
        self.constvars = list(self.jaxpr.constvars)
        self.kind: list[str] = [self._kind(e) for e in self.eqns]

    def _kind(self, eqn: Any) -> str:
        name = eqn.primitive.name
        if name == "reshape" or name in ("squeeze", "expand_dims"):
            return "absorbed" if is_unit_reshape(eqn, self.traces) else "glue"
        if name in ELEMENTWISE or _same_width_bitcast(eqn):
            return "elementwise"
        if name in ABSORBED:
            return "absorbed"
        if name in REDUCE:
            return "reduce"
        if name in DOT:
            return "dot"
        if name in GLUE:
            return "glue"
        if name in RANDOM:
            return "random"
        if name in ("scatter", "scatter-add", "scatter_add"):  # only whole-row scatters outlive the trace
            return "glue"
        if name in EQUATION_KINDS:  # owned outright by a template family
            return EQUATION_KINDS[name]
        return "unsupported"

    def check_supported(self) -> None:
        bad = [e.primitive.name for e, k in zip(self.eqns, self.kind, strict=True) if k == "unsupported"]
        if bad:
            uniq = list(dict.fromkeys(bad))
            what = "; ".join(UNSUPPORTED_HINTS.get(n, f"the primitive `{n}`") for n in uniq)
            raise Unsupported(
                f"the reference uses {what} ({', '.join(uniq)}), which the offline author has no kernel "
                "template for"
            )

    def unit(self, var: Any, dim: int) -> bool:
        return self.traces.unit(var, dim)

    def nonunit_dims(self, var: Any) -> list[int]:
        if is_literal(var):
            return []
        return [d for d in range(len(var.aval.shape)) if not self.unit(var, d)]
