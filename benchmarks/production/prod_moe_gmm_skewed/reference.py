"""The expert matmuls of a mixture-of-experts layer after routing (Qwen3-30B-A3B: 128 experts, hidden
2048, expert FFN 768, 8 experts per token): tokens sorted by expert, each expert's rows multiplied by its
gate and up projections, SwiGLU, then its down projection. Routing is skewed as real routers are: group
sizes follow a Zipf-like law (a few hot experts take many rows, many take few, some none)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp
    import numpy as np

    if scale == "tpu":
        rows, hidden, ffn, experts = 32768, 2048, 768, 128
    else:
        rows, hidden, ffn, experts = 512, 256, 128, 16
    # Zipf-like shares with exponent 1.1, in a shuffled expert order; rounded to whole rows summing to
    # `rows` (the largest remainders get the leftover rows), so some experts get none
    share = 1.0 / np.arange(1, experts + 1) ** 1.1
    share = share[np.random.default_rng(305).permutation(experts)] / share.sum()
    raw = share * rows
    sizes = np.floor(raw).astype(np.int64)
    sizes[np.argsort(raw - sizes)[::-1][: rows - sizes.sum()]] += 1
    kx, kg, ku, kd = jax.random.split(jax.random.key(305), 4)
    x = jax.random.normal(kx, (rows, hidden), jnp.float32).astype(dtype)
    w_gate = (jax.random.normal(kg, (experts, hidden, ffn), jnp.float32) * hidden**-0.5).astype(dtype)
    w_up = (jax.random.normal(ku, (experts, hidden, ffn), jnp.float32) * hidden**-0.5).astype(dtype)
    w_down = (jax.random.normal(kd, (experts, ffn, hidden), jnp.float32) * ffn**-0.5).astype(dtype)
    return [x, w_gate, w_up, w_down, jnp.asarray(sizes, jnp.int32)], []


def computation(x, w_gate, w_up, w_down, group_sizes):
    gate = lax.ragged_dot(x, w_gate, group_sizes, preferred_element_type=jnp.float32)
    up = lax.ragged_dot(x, w_up, group_sizes, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(gate) * up).astype(x.dtype)
    return lax.ragged_dot(h, w_down, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)
