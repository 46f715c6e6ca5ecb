"""(2x)^T @ w with bf16 operands and an f32 result, a test task: a kernel that writes 2x, transposes it
outside Pallas and feeds a bf16 matmul kernel is correct, yet XLA:CPU cannot run that program through
Pallas's plain interpreter (it folds the transpose into a bf16 x bf16 -> f32 dot it has no kernel for)."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    k, m, n = (1024, 512, 256) if scale == "tpu" else (256, 128, 128)
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (k, m), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(dtype)
    return [x, w], []


def computation(x, w):
    return jnp.dot(jnp.transpose(x * 2), w, preferred_element_type=jnp.float32)
