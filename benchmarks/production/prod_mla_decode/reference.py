"""Multi-head latent attention decode with a compressed KV cache (DeepSeek-V3: 128 heads, KV latent
rank 512, decoupled RoPE key dim 64, value head dim 128), in the absorbed form serving engines use: the
query's no-RoPE part is already multiplied into the latent space, so each head scores the cached
576-wide entries (latent plus RoPE key) directly, attends over the latent part, and the result is
projected up to the head's value dim. Each sequence has its own context length in a fixed-size cache."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, h, rank, rope, dv, t = 64, 128, 512, 64, 128, 4096
    else:
        b, h, rank, rope, dv, t = 4, 16, 128, 64, 128, 256
    kq, kc, kw, kl = jax.random.split(jax.random.key(306), 4)
    q = jax.random.normal(kq, (b, h, rank + rope), jnp.float32).astype(dtype)
    cache = jax.random.normal(kc, (b, t, rank + rope), jnp.float32).astype(dtype)
    w_uv = (jax.random.normal(kw, (h, rank, dv), jnp.float32) * rank**-0.5).astype(dtype)
    lengths = jax.random.randint(kl, (b,), 1, t + 1).astype(jnp.int32)
    return [q, cache, w_uv, lengths], [float(128 + rope) ** -0.5]


def computation(q, cache, w_uv, lengths, sm_scale):
    rank = w_uv.shape[1]
    logits = jnp.einsum("bhc,btc->bht", q, cache, preferred_element_type=jnp.float32) * sm_scale
    valid = jnp.arange(cache.shape[1])[None, None, :] < lengths[:, None, None]
    logits = jnp.where(valid, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(cache.dtype)
    latent = jnp.einsum("bht,btr->bhr", probs, cache[:, :, :rank], preferred_element_type=jnp.float32)
    per_head = jnp.swapaxes(latent.astype(cache.dtype), 0, 1)  # [h, b, rank]: the head is the batch dim
    out = jnp.einsum("hbr,hrv->hbv", per_head, w_uv, preferred_element_type=jnp.float32)
    return jnp.swapaxes(out, 0, 1).astype(q.dtype)
