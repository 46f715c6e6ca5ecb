"""Rotary position embedding (rotate-half convention) applied to x [batch, seq, heads, head_dim] at
integer positions [batch, seq], base theta (Llama-3 uses 500000)."""

import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, s, h, d, max_pos = 8, 4096, 32, 128, 8192
    else:
        b, s, h, d, max_pos = 2, 128, 4, 128, 256
    k_x, k_p = jax.random.split(jax.random.key(21))
    x = jax.random.normal(k_x, (b, s, h, d), jnp.float32).astype(dtype)
    positions = jax.random.randint(k_p, (b, s), 0, max_pos, jnp.int32)
    return [x, positions], [500000.0]


def computation(x, positions, theta):
    d = x.shape[-1]
    half = d // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / d))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, s, half]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
