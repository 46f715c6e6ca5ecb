"""Tell sizes that follow the inputs from constants, by comparing one program traced at two scales.

A jaxpr has its sizes baked in (`reshape[new_sizes=(128, 8192)]`, `div x 16384.0`). The written reference
must run at the task's own shapes *and* at its CPU-scale shapes (and at the harness's larger check shape),
so a size that differs between the two traces is written as an expression of variables' shapes
(`x.shape[0]`, `y.shape[1] * y.shape[2]`), found by fitting both values at once: a single dimension, a
product of adjacent dimensions of one array, either times or divided by a constant, or one dimension plus
a constant. A value equal at both scales stays a literal. What cannot be fitted is reported, never guessed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Known:
    code: str
    """How the written function refers to the array (a variable name)."""
    shapes: tuple[tuple[int, ...], ...]
    """Its shape at each traced scale (the task's own first)."""


class SizeFitter:
    """Arrays in scope, in the order they were defined; `fit` writes a size in terms of their shapes.

    Every candidate must hold at every traced scale at once; the more scales (and the less proportional
    they are to one another), the fewer coincidences. Among candidates of one kind the one with the
    smallest constant wins (`y.shape[1] // 4` over `y.shape[0] // 16`)."""

    def __init__(self) -> None:
        self.known: list[Known] = []

    def add(self, code: str, shapes: list[tuple[int, ...]]) -> None:
        if len({len(s) for s in shapes}) == 1 and len(set(shapes)) > 1:
            self.known.append(Known(code, tuple(shapes)))

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Names defined inside a loop body are not visible after it."""
        mark = len(self.known)
        try:
            yield
        finally:
            del self.known[mark:]

    def _ordered(self, prefer: list[str]) -> list[Known]:
        first = [k for name in prefer for k in self.known if k.code == name]
        return first + [k for k in reversed(self.known) if k not in first]

    def fit(self, values: list[int], prefer: list[str] | None = None) -> str | None:
        """An expression equal to `values[i]` at scale i, or None."""
        vals = tuple(int(v) for v in values)
        if len(set(vals)) == 1:
            return str(vals[0])
        arrays = self._ordered(prefer or [])
        terms: list[tuple[str, tuple[int, ...]]] = []
        for k in arrays:
            for i in range(len(k.shapes[0])):
                terms.append((f"{k.code}.shape[{i}]", tuple(s[i] for s in k.shapes)))
        for code, dims in terms:
            if dims == vals:
                return code
        products: list[tuple[str, tuple[int, ...]]] = []
        for k in arrays:
            n = len(k.shapes[0])
            for i, j in itertools.combinations(range(n + 1), 2):
                if j - i < 2:
                    continue
                dims = tuple(math.prod(s[i:j]) for s in k.shapes)
                code = " * ".join(f"{k.code}.shape[{d}]" for d in range(i, j))
                if dims == vals:
                    return code
                products.append((code, dims))
        best: tuple[int, str] | None = None
        for code, dims in terms + products:
            for factor, text in (_ratio(vals, dims, "*"), _ratio(dims, vals, "//")):
                if factor and (best is None or factor < best[0]):
                    best = (factor, f"{_paren(code)} {text} {factor}")
        if best is not None:
            return best[1]
        for code, dims in terms:
            deltas = {v - d for v, d in zip(vals, dims, strict=True)}
            if len(deltas) == 1:
                (delta,) = deltas
                if 0 < abs(delta) <= min(dims) // 2:
                    return f"{code} {'+' if delta > 0 else '-'} {abs(delta)}"
        return None

    def fit_number(self, values: list[float], prefer: list[str] | None = None) -> str | None:
        """A float literal that follows the sizes: N, 1/N, sqrt(N) or 1/sqrt(N) for a fitted size N."""
        candidates = (
            (lambda v: v, "{}"),
            (lambda v: 1.0 / v, "1.0 / ({})"),
            (lambda v: v * v, "({}) ** 0.5"),
            (lambda v: 1.0 / (v * v), "({}) ** -0.5"),
        )
        for inverse, template in candidates:
            try:
                mapped = [inverse(v) for v in values]
            except ZeroDivisionError:
                continue
            rounded = [round(m) for m in mapped]
            if any(
                r <= 0 or not math.isclose(m, r, rel_tol=1e-5) for m, r in zip(mapped, rounded, strict=True)
            ):
                continue
            if len(set(rounded)) == 1:
                continue
            code = self.fit(rounded, prefer)
            if code is not None:
                return template.format(code)
        return None


def _ratio(big: tuple[int, ...], small: tuple[int, ...], op: str) -> tuple[int, str]:
    """The integer k > 1 with big[i] == small[i] * k at every scale, else (0, op)."""
    if any(s == 0 or b % s for b, s in zip(big, small, strict=True)):
        return 0, op
    ks = {b // s for b, s in zip(big, small, strict=True)}
    if len(ks) == 1 and (k := ks.pop()) > 1:
        return k, op
    return 0, op


def _paren(code: str) -> str:
    return f"({code})" if " " in code else code
