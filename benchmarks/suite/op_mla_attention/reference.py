"""Multi-head latent attention (DeepSeek-V2 style): keys/values are up-projected from a
low-rank compressed KV latent, plus a decoupled rotary key shared by all heads; causal."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, s, h, d_nope, d_rope, d_c, d_v = 4, 4096, 16, 128, 64, 512, 128
    else:
        b, s, h, d_nope, d_rope, d_c, d_v = 2, 128, 4, 64, 32, 128, 64
    ks = jax.random.split(jax.random.key(4), 5)
    q = jax.random.normal(ks[0], (b, s, h, d_nope + d_rope), jnp.float32).astype(dtype)
    c_kv = jax.random.normal(ks[1], (b, s, d_c), jnp.float32).astype(dtype)
    k_rope = jax.random.normal(ks[2], (b, s, d_rope), jnp.float32).astype(dtype)
    w_uk = (jax.random.normal(ks[3], (d_c, h, d_nope), jnp.float32) * d_c**-0.5).astype(dtype)
    w_uv = (jax.random.normal(ks[4], (d_c, h, d_v), jnp.float32) * d_c**-0.5).astype(dtype)
    return [q, c_kv, k_rope, w_uk, w_uv], [float(d_nope + d_rope) ** -0.5]


def computation(q, c_kv, k_rope, w_uk, w_uv, sm_scale):
    hp = lax.Precision.HIGHEST
    f32 = jnp.float32
    s_q, s_k = q.shape[1], c_kv.shape[1]
    d_nope = w_uk.shape[-1]
    causal = jnp.arange(s_q)[:, None] >= jnp.arange(s_k)[None, :]

    def one_batch(args):
        qb, cb, krb = args  # [s, h, d_nope + d_rope], [s, d_c], [s, d_rope]
        k_nope = jnp.einsum("sc,chd->shd", cb, w_uk, preferred_element_type=f32, precision=hp)
        v = jnp.einsum("sc,chd->shd", cb, w_uv, preferred_element_type=f32, precision=hp)
        q_nope = qb[..., :d_nope].astype(f32)
        q_rope = qb[..., d_nope:].astype(f32)
        s = jnp.einsum("qhd,khd->hqk", q_nope, k_nope, precision=hp)
        s = s + jnp.einsum("qhr,kr->hqk", q_rope, krb.astype(f32), precision=hp)
        s = jnp.where(causal, s * sm_scale, -jnp.inf)
        p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        p = p / jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("hqk,khd->qhd", p, v, precision=hp)
        return o.astype(q.dtype)

    return lax.map(one_batch, (q, c_kv, k_rope))
