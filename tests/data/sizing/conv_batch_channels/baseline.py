"""Conv + bias in the JAXBench workload format (maxkernel test): the batch and the output channels are both
128, written as separate literals. Only the batch may shrink: 128 output channels are a lane dimension."""

import jax
import jax.numpy as jnp

CONFIG = {"name": "conv_batch_channels"}


def create_inputs(dtype=jnp.float32):
    batch, cin, cout = 128, 8, 128
    height = width = 16
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k1, (batch, cin, height, width), dtype)  # NCHW
    w = jax.random.normal(k2, (cout, cin, 3, 3), dtype) * 0.1  # OIHW
    b = jax.random.normal(k3, (cout,), dtype)
    return x, w, b


def workload(x, w, b):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return jax.nn.relu(y + b[None, :, None, None])
