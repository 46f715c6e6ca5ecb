"""The kernel families of the offline author, in one table: adding a family is one entry here.

A family is a kind of region (one `pallas_call`) with

* the jaxpr primitives it owns outright (`primitives`: the data-flow graph gives them the family's own
  equation kind, so nothing else claims them and `check_supported` lets them through);
* a matcher: given the partition and an owned equation that no region holds yet, it either claims the
  equation (creating or growing regions) and returns True, or declines and the next family is asked;
* its builder class (`maxkernel.authors.offline.kernels.KernelBuilder` subclass), named lazily as
  "module:Class" so this module imports no builder (builders import the partition, which reads this table);
* whether the region is a fixed template, which nothing joins but a cast of its result.

`Graph` reads `EQUATION_KINDS` (primitive -> equation kind), `Partition.run` walks `FAMILIES` in order with
each equation, and `Lowering` asks `builder_for(region.kind)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from maxkernel.authors.offline.kernels import KernelBuilder
    from maxkernel.authors.offline.partition import Partition

Matcher = Callable[["Partition", int], bool]


@dataclass(frozen=True)
class Family:
    kind: str = field(metadata={"doc": "region kind, e.g. 'matmul'"})
    builder: str = field(metadata={"doc": "'module:Class' of its KernelBuilder"})
    starts: frozenset[str] = field(metadata={"doc": "equation kinds (Graph.kind) it may start from"})
    matcher: Matcher
    primitives: frozenset[str] = frozenset()
    fixed_template: bool = False
    doc: str = ""


# --- matchers ---------------------------------------------------------------------------------------------
def _own_alone(part: Partition, i: int, kind: str, *, axes: bool = True) -> bool:
    """A region holding exactly equation `i` (a template family); `axes`: record its dims' classes (a
    scan's operands and results have no elementwise correspondence, so it records none)."""
    r = part.new_region(kind)
    r.owned.append(i)
    if axes:
        r.axes.add(part.g.eqns[i])
    part.owner[i] = r.id
    return True


def _match_grouped(part: Partition, i: int) -> bool:
    return _own_alone(part, i, "grouped")


def _match_conv(part: Partition, i: int) -> bool:
    return _own_alone(part, i, "conv", axes=False)


def _match_scan(part: Partition, i: int) -> bool:
    # Light work feeding the scan's operands (a zeros init, a cast, an exp of a slice) runs as XLA glue:
    # the template reads whole operands and re-emits only the scan body.
    for v in part.g.eqns[i].invars:
        for p in part.float_closure(v):
            part.status[p] = "glue"
    return _own_alone(part, i, "scan", axes=False)


def _match_attention(part: Partition, i: int) -> bool:
    from maxkernel.authors.offline.attention import match_attention

    return part.opt.attention and match_attention(part, i) is not None


def _match_matmul(part: Partition, i: int) -> bool:
    part.start(i, "matmul")
    return True


def _match_map(part: Partition, i: int) -> bool:
    homes = part.homes(part.g.eqns[i])
    if homes and part.join(homes, i):
        return True
    if not homes and part.join_sibling(i):
        return True
    part.start(i, "map")
    return True


FAMILIES: tuple[Family, ...] = (
    Family(
        kind="grouped",
        builder="maxkernel.authors.offline.grouped:GroupedMatmulBuilder",
        starts=frozenset({"ragged"}),
        matcher=_match_grouped,
        primitives=frozenset({"ragged_dot_general"}),
        fixed_template=True,
        doc="lax.ragged_dot: group sizes by scalar prefetch, steps of empty groups skipped",
    ),
    Family(
        kind="conv",
        builder="maxkernel.authors.offline.conv_kernel:ConvBuilder",
        starts=frozenset({"conv"}),
        matcher=_match_conv,
        primitives=frozenset({"conv_general_dilated"}),
        fixed_template=True,
        doc="stride-1 convolution: one matmul per kernel tap over a VMEM-resident sample (no im2col)",
    ),
    Family(
        kind="scan",
        builder="maxkernel.authors.offline.window_scan:WindowScanBuilder",
        starts=frozenset({"scan"}),
        matcher=_match_scan,
        primitives=frozenset({"scan"}),
        fixed_template=True,
        doc="lax.scan with a carry: one sequential grid step per iteration, the carry in VMEM scratch (or in HBM "
        "through row windows moved by DMA, when the body reads it with dynamic_slice)",
    ),
    Family(
        kind="attention",
        builder="maxkernel.authors.offline.attention_kernel:AttentionBuilder",
        starts=frozenset({"dot"}),
        matcher=_match_attention,
        doc="q·kᵀ, score function, softmax, ·v as flash attention (online softmax over key blocks)",
    ),
    Family(
        kind="matmul",
        builder="maxkernel.authors.offline.matmul_kernel:MatmulBuilder",
        starts=frozenset({"dot"}),
        matcher=_match_matmul,
        doc="dot_general with its elementwise (and row-reduction) epilogue",
    ),
    Family(
        kind="map",
        builder="maxkernel.authors.offline.map_kernel:MapBuilder",
        starts=frozenset({"reduce", "elementwise", "absorbed"}),
        matcher=_match_map,
        doc="elementwise maps and reductions: joins its operands' region, or starts a row-wise kernel",
    ),
)
"""Asked in this order; the first matcher that claims an equation wins."""

FAMILY_OF: dict[str, Family] = {f.kind: f for f in FAMILIES}

EQUATION_KINDS: dict[str, str] = {p: kind for f in FAMILIES for kind in f.starts for p in f.primitives}
"""Primitives a family owns outright, with the equation kind the data-flow graph gives them."""


def families_starting(equation_kind: str) -> list[Family]:
    return [f for f in FAMILIES if equation_kind in f.starts]


@cache
def builder_for(kind: str) -> type[KernelBuilder]:
    """The builder class of a region kind (imported on first use)."""
    module, _, name = FAMILY_OF[kind].builder.partition(":")
    cls: Any = getattr(importlib.import_module(module), name)
    return cls
