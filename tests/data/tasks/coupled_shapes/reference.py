"""Rows of x folded into an s x s grid (s = pos rows) plus a per-row position vector: the sizes of x and
pos are coupled (x rows = s * s), as tokens = (image / patch)^2 couples a patch embedding's inputs."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.float32, scale="tpu"):
    s, d = (32, 256) if scale == "tpu" else (8, 128)
    kx, kp = jax.random.split(jax.random.key(3))
    return [jax.random.normal(kx, (s * s, d), dtype), jax.random.normal(kp, (s, d), dtype)], []


def computation(x, pos):
    s, d = pos.shape
    return x.reshape(s, s, d) + pos[:, None, :]
