"""Random bits as elementwise work: `random_bits` on a threefry key, rewritten into 32-bit integer maps.

With `jax_threefry_partitionable` on (the default in JAX 0.10), the bits of element `i` of a
`jax.random.bits(key, shape, uint32)` draw are `x0 ^ x1` where `(x0, x1) = threefry2x32(key, (hi, lo))`
and `(hi, lo)` are the high and low words of `i`, the row-major flat index of the element in `shape`
(`prng.iota_2x32_shape` in jax/_src/random). That is a pure function of the two key words and the
element's coordinates, so a kernel can compute the bits of exactly the block it holds: the mask never
goes through HBM.

The trace rewrite (`trace._apply`) replaces such a `random_bits` with the equations `threefry_bits` below
traces into: the key words are two scalars sliced off `key_data` (layout glue outside the kernel), the
flat index is built from iotas and the dims' extents (shape numbers, which the trace resolver derives
from the inputs), and the 20 rounds of threefry2x32 are uint32 add / xor / shift / or maps.
All of it is elementwise, so the partitioner lets it into whichever kernel uses the bits.

Only what this rewrite reproduces bit for bit is rewritten: threefry keys, partitionable counters,
32-bit draws of fewer than 2**32 elements (the high counter word is then zero).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
"""Threefry-2x32 rotation constants: the even and odd groups of four rounds (Salmon et al., SC'11)."""

KEY_PARITY = 0x1BD11BDA
"""The third key-schedule word is k0 ^ k1 ^ this constant."""

MAX_ELEMENTS = 1 << 32
"""Draws this large need the counter's high word; they are left to XLA."""


def rewritable(key: Any, params: dict[str, Any]) -> bool:
    """Can `random_bits(key, **params)` be rewritten bit-exactly into maps?"""
    shape = tuple(params.get("shape", ()))
    if not shape or params.get("bit_width") != 32 or not jax.config.jax_threefry_partitionable:
        return False
    if getattr(key, "shape", None) != () or not all(isinstance(d, int) for d in shape):
        return False
    if math.prod(shape) >= MAX_ELEMENTS:
        return False
    try:
        impl = jax.random.key_impl(key)
    except (TypeError, ValueError):
        return False
    return "threefry" in str(impl)


def _rotl(x: Any, r: int) -> Any:
    return lax.shift_left(x, np.uint32(r)) | lax.shift_right_logical(x, np.uint32(32 - r))


def threefry2x32(k0: Any, k1: Any, x0: Any, x1: Any) -> tuple[Any, Any]:
    """Threefry-2x32 with 20 rounds on uint32 arrays (`k0`, `k1` may be scalars): five groups of four
    mix rounds, each group followed by a key injection."""
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(KEY_PARITY))
    x0 = x0 + ks[0]
    x1 = x1 + ks[1]
    for group in range(5):
        for r in ROTATIONS[group % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(group + 1) % 3]
        x1 = x1 + (ks[(group + 2) % 3] + np.uint32(group + 1))  # scalar sum first: one vector add
    return x0, x1


def flat_index(shape: tuple[int, ...]) -> Any:
    """Row-major flat index of every element of `shape`, as uint32 (the counter's low word).

    Horner form, `(i0 * d1 + i1) * d2 + i2`: every literal it multiplies by is one dim's extent, which
    the trace resolver derives from the inputs' shapes in every configuration (a product of extents,
    a row stride, is a number it would have to find as a product)."""
    flat = lax.broadcasted_iota(jnp.uint32, shape, 0)
    for d in range(1, len(shape)):
        flat = flat * np.uint32(shape[d]) + lax.broadcasted_iota(jnp.uint32, shape, d)
    return flat


def threefry_bits(key: Any, shape: tuple[int, ...]) -> Any:
    """`jax.random.bits(key, shape, jnp.uint32)` for a threefry key, as maps of the flat index."""
    data = jax.random.key_data(key)  # u32[2]
    k0 = lax.squeeze(lax.slice(data, (0,), (1,)), (0,))  # u32[]
    k1 = lax.squeeze(lax.slice(data, (1,), (2,)), (0,))  # u32[]
    lo = flat_index(shape)
    hi = jnp.zeros(shape, jnp.uint32)  # fewer than 2**32 elements: the high word is zero
    x0, x1 = threefry2x32(k0, k1, hi, lo)
    return x0 ^ x1
