"""AlphaFold triangle multiplicative update, outgoing edges, on a pair representation z [N, N, C]:
LayerNorm, gated projections a/b, p_ij = sum_k a_ik * b_jk, LayerNorm, output projection, sigmoid gate."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, c, ch = 768, 128, 128
    else:
        n, c, ch = 64, 64, 64
    ks = jax.random.split(jax.random.key(20), 11)

    def w(key, shape):
        return (jax.random.normal(key, shape, jnp.float32) * shape[0] ** -0.5).astype(dtype)

    def affine(k1, k2, size):
        g = 1.0 + 0.1 * jax.random.normal(k1, (size,), jnp.float32)
        b = 0.1 * jax.random.normal(k2, (size,), jnp.float32)
        return g.astype(dtype), b.astype(dtype)

    z = jax.random.normal(ks[0], (n, n, c), jnp.float32).astype(dtype)
    ln_in_w, ln_in_b = affine(ks[1], ks[2], c)
    w_a_p, w_a_g = w(ks[3], (c, ch)), w(ks[4], (c, ch))
    w_b_p, w_b_g = w(ks[5], (c, ch)), w(ks[6], (c, ch))
    w_g = w(ks[7], (c, c))
    ln_out_w, ln_out_b = affine(ks[8], ks[9], ch)
    w_o = w(ks[10], (ch, c))
    return [z, ln_in_w, ln_in_b, w_a_p, w_a_g, w_b_p, w_b_g, w_g, ln_out_w, ln_out_b, w_o], [1e-5]


def computation(z, ln_in_w, ln_in_b, w_a_p, w_a_g, w_b_p, w_b_g, w_g, ln_out_w, ln_out_b, w_o, eps):
    hp = lax.Precision.HIGHEST
    f32 = jnp.float32

    def layer_norm(t, g, b):
        mean = jnp.mean(t, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(t - mean), axis=-1, keepdims=True)
        return (t - mean) * lax.rsqrt(var + eps) * g.astype(f32) + b.astype(f32)

    def proj(t, w):
        return jnp.dot(t, w.astype(f32), precision=hp)

    zn = layer_norm(z.astype(f32), ln_in_w, ln_in_b)
    a = jax.nn.sigmoid(proj(zn, w_a_g)) * proj(zn, w_a_p)
    b = jax.nn.sigmoid(proj(zn, w_b_g)) * proj(zn, w_b_p)
    p = jnp.einsum("ikc,jkc->ijc", a, b, precision=hp)
    out = proj(layer_norm(p, ln_out_w, ln_out_b), w_o) * jax.nn.sigmoid(proj(zn, w_g))
    return out.astype(z.dtype)
