"""Reductions along an axis walked in blocks across grid steps, shared by the kernel families that stream one.

A row-wise kernel whose reduced axis is too long for one block, and a matmul whose epilogue reduces along an
N too long for one (bm, N) tile (a cross-entropy over a large vocabulary), both walk that axis as a
sequential ("arbitrary") grid axis. Each reduction keeps an f32 accumulator in VMEM scratch: initialised at
the first block, updated per block (a `sum(exp(a - max(a)))` rescaled against the running max, see
online.py), and read by the finishing ops at the last block, which store the outputs. Columns past the end
of the axis (an edge block that overhangs it) are masked out of every update.

The emitted lines go wherever the family runs its per-block work: at every step of a row-wise kernel, at
the last K step of a matmul (its epilogue), so the `[rows, N]` values never leave VMEM.
"""

from __future__ import annotations

from typing import Any

from maxkernel.authors.offline.dataflow import is_literal
from maxkernel.authors.offline.emit import dtype_code, dtype_name
from maxkernel.authors.offline.kernels import Builder, Scope, Space, SpaceDim
from maxkernel.authors.offline.online import online_sums

INIT = {
    "reduce_sum": "jnp.zeros_like({a})",
    "reduce_max": "jnp.full_like({a}, -jnp.inf)",
    "reduce_min": "jnp.full_like({a}, jnp.inf)",
}
NEUTRAL = {"reduce_sum": "0", "reduce_max": "-jnp.inf", "reduce_min": "jnp.inf"}
COMBINE = {
    "reduce_sum": "{a} + {b}",
    "reduce_max": "jnp.maximum({a}, {b})",
    "reduce_min": "jnp.minimum({a}, {b})",
}
BLOCK_REDUCE = {"reduce_sum": "jnp.sum", "reduce_max": "jnp.max", "reduce_min": "jnp.min"}


class StreamedReductions(Builder):
    """Mixin for builders whose region has `stream` set: the walked axis is a `seq` space dim."""

    def stream_reductions(self) -> list[int]:
        """The region's reductions, in program order (one accumulator each)."""
        return [i for i in sorted(self.region.owned) if self.g.kind[i] == "reduce"]

    def stream_scratch(self, space: Space, prefix: str) -> list[tuple[str, str, list[SpaceDim | str]]]:
        """One f32 accumulator per reduction: the block's shape with the walked axis reduced to 1."""
        dims: list[SpaceDim | str] = [("1" if d.role == "seq" else d) for d in space.dims]
        return [
            (f"{prefix}{k}_ref", "jnp.float32", list(dims)) for k, _ in enumerate(self.stream_reductions())
        ]

    def streamed_body(
        self, main: Scope, space: Space, red: SpaceDim, names: list[str], prefix: str
    ) -> list[str]:
        """Lines (at `main`'s indent) that fold this block of `red` into the accumulators `<prefix>k_ref`,
        and at the last block of `red` compute and store every output that depends on a reduction. Outputs
        that do not are stored on every step (their blocks follow the grid as usual). `main.special` may
        already carry values the family computes itself (a matmul's accumulator)."""
        g = self.g
        pos = space.dims.index(red)
        r_index = self.program_id(red.axis)  # type: ignore[arg-type]
        reds = self.stream_reductions()
        acc = [f"{prefix}{k}_ref" for k in range(len(reds))]
        main.add(f"@pl.when({r_index} == 0)")
        main.add("def _init():")
        for k, i in enumerate(reds):
            main.add(f"    {acc[k]}[...] = " + INIT[g.eqns[i].primitive.name].format(a=acc[k]))
        main.add("")
        self.kw("n_red", red.ext)
        self.kw(red.blk, red.blk)
        shape = ["1"] * len(space.dims)
        shape[pos] = red.blk
        main.add(
            f"valid = {r_index} * {red.blk} + lax.broadcasted_iota(jnp.int32, ({', '.join(shape)},), {pos}) "
            "< n_red  # positions past the end of the walked axis take no part"
        )
        post_vars: set[Any] = set()
        for i in sorted(self.region.eqns()):
            e = g.eqns[i]
            if g.kind[i] == "reduce" or any(v in post_vars for v in e.invars if not is_literal(v)):
                post_vars.update(e.outvars)
        online = online_sums(g, self.region.eqns())
        slot = {i: k for k, i in enumerate(reds)}
        running: dict[int, tuple[str, str]] = {}  # max eqn -> (old running max, new running max)
        for i in dict.fromkeys(o.max_eqn for o in online.values()):
            # the running max of this block first: the online sums below rescale against it
            k = slot[i]
            e = g.eqns[i]
            src = self._block_operand(e.invars[0], red, space, main)
            old, new = self.fresh("m_prev"), self.fresh("m_next")
            main.add(f"{old} = {acc[k]}[...]  # running max before this block")
            main.add(
                f"{new} = jnp.maximum({old}, jnp.max(jnp.where(valid, {src}, -jnp.inf), axis={pos}, "
                "keepdims=True))"
            )
            running[i] = (old, new)
            out = e.outvars[0]

            def current(
                scope: Scope, space: Space, new: str = new, out: Any = out
            ) -> tuple[str, frozenset[str]]:
                dt = dtype_name(out.aval)
                mat = frozenset(d.key for d in space.dims if d.role != "seq" and self.spans(out, d))
                return (new if dt == "float32" else f"{new}.astype({dtype_code(dt)})"), mat

            main.special[out] = current
        for k, i in enumerate(reds):
            e = g.eqns[i]
            name = e.primitive.name
            if i in running:
                continue  # stored below, after the sums that rescale against the old value
            src = self._block_operand(e.invars[0], red, space, main)
            part = (
                f"{BLOCK_REDUCE[name]}(jnp.where(valid, {src}, {NEUTRAL[name]}), axis={pos}, keepdims=True)"
            )
            if i in online:
                old, new = running[online[i].max_eqn]
                scale = self.fresh("rescale")
                if online[i].finite_shift:
                    # jax.nn.logsumexp shifts by where(isfinite(max), max, 0); a row whose max was still
                    # -inf has summed nothing yet (and exp(0 - shift) could overflow), so its factor is 0
                    shift = "jnp.where(jnp.isfinite({x}), {x}, 0.0)"
                    main.add(
                        f"{scale} = jnp.where({old} == -jnp.inf, 0.0, "
                        f"jnp.exp({shift.format(x=old)} - {shift.format(x=new)}))"
                    )
                else:
                    main.add(f"{scale} = jnp.where({new} == -jnp.inf, 0.0, jnp.exp({old} - {new}))")
                main.add(f"{acc[k]}[...] = {acc[k]}[...] * {scale} + {part}")
                continue
            main.add(f"{acc[k]}[...] = " + COMBINE[name].format(a=f"{acc[k]}[...]", b=part))
        for i, (_, new) in running.items():
            main.add(f"{acc[slot[i]]}[...] = {new}")
        for v, nm in zip(self.outputs, names, strict=True):
            if v not in post_vars:
                self.store(v, f"{nm}_ref", space, main)
        main.add("")
        main.add(f"@pl.when({r_index} == pl.num_programs({red.axis}) - 1)")
        main.add("def _finish():")
        fin = Scope(lines=[], indent=main.indent + "    ")
        for k, i in enumerate(reds):
            out = g.eqns[i].outvars[0]
            dt = dtype_name(out.aval)

            def load(
                scope: Scope, space: Space, ref: str = acc[k], dt: str = dt, out: Any = out
            ) -> tuple[str, frozenset[str]]:
                nm = self.fresh("acc")
                cast = "" if dt == "float32" else f".astype({dtype_code(dt)})"
                mat = frozenset(d.key for d in space.dims if d.role != "seq" and self.spans(out, d))
                scope.add(f"{nm} = {ref}[...]{cast}" + self.comment(dt, space, mat))
                return nm, mat

            fin.special[out] = load
        for v, nm in zip(self.outputs, names, strict=True):
            if v in post_vars:
                self.store(v, f"{nm}_ref", space, fin)
        if not fin.lines:
            fin.add("pass")
        return main.lines + fin.lines

    def _block_operand(self, x: Any, red: SpaceDim, space: Space, scope: Scope) -> str:
        """A reduction's operand on this block, materialised along the walked axis, in f32."""
        code, mat = self.value(x, space, scope)
        need = {d.key for d in space.dims if self.spans(x, d)} | {red.key}
        code, mat = self.materialise(code, mat, need, space, scope, dtype_name(x.aval))
        return code if dtype_name(x.aval) == "float32" else f"{code}.astype(jnp.float32)"
