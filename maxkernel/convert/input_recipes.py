"""How the converted task draws its inputs and weights: a recipe per array, read off PyTorch's own draws.

The JAX task cannot call `torch.rand` or `nn.Linear.reset_parameters`, so each array's distribution is
recognised from the values PyTorch produced at the CPU scale and written as the matching `jax.random` call:
a constant (norm weights and biases), uniform on a range (`torch.rand`, PyTorch's default Kaiming-uniform
weights, whose bound 1/sqrt(fan_in) is recomputed at each scale), normal, integers in a range (class
labels), booleans, a small set of values (±1 targets), rows of a softmax, and otherwise a normal with the
observed mean and spread clipped to the observed range. The recipe is stated next to each line of
`get_inputs`, and the conversion is verified on draws of these recipes as well as on PyTorch's own draws.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, Field


class Recipe(BaseModel):
    kind: str = Field(
        description="constant | uniform | normal | integers | bool | choice | softmax | clipped_normal"
    )
    dtype: str
    params: dict[str, Any] = Field(default_factory=dict)
    fan_in_bound: bool = Field(
        False, description="uniform(-b, b) with b = 1/sqrt(fan_in): recomputed per scale"
    )
    note: str = ""


STATS_SAMPLE = 1 << 18


def _nice(v: float) -> float:
    return float(f"{v:.6g}")


def fan_in(shape: tuple[int, ...]) -> int:
    """PyTorch's fan-in of a weight: dim 1 times the receptive field (`_calculate_fan_in_and_fan_out`)."""
    if len(shape) < 2:
        return 0
    return int(shape[1] * math.prod(shape[2:]))


def recognise(values: np.ndarray, fan_ins: list[int]) -> Recipe:
    """A recipe for an array drawn like `values`. `fan_ins`: the fan-ins of the model's weights at this
    scale (a bias is drawn with its weight's bound)."""
    dtype = str(values.dtype)
    flat = values.reshape(-1)
    if flat.size == 0:
        return Recipe(kind="constant", dtype=dtype, params={"value": 0})
    if values.dtype == np.bool_:
        return Recipe(kind="bool", dtype=dtype, params={"p": _nice(float(flat.mean()))}, note="Bernoulli")
    if np.issubdtype(values.dtype, np.integer):
        lo, hi = int(flat.min()), int(flat.max())
        return Recipe(
            kind="integers", dtype=dtype, params={"low": lo, "high": hi + 1}, note="integers in a range"
        )
    if flat.size > STATS_SAMPLE:  # statistics from an even subsample: megabytes of draws say no more
        flat = flat[:: flat.size // STATS_SAMPLE + 1]
    f = flat.astype(np.float64)
    lo, hi, mean, std = float(f.min()), float(f.max()), float(f.mean()), float(f.std())
    if std == 0.0:
        return Recipe(kind="constant", dtype=dtype, params={"value": _nice(lo)}, note="constant")
    distinct = np.unique(f)
    if distinct.size <= 16 and f.size >= 64:
        probs = [float((f == d).mean()) for d in distinct]
        return Recipe(kind="choice", dtype=dtype, params={"values": [_nice(d) for d in distinct],
                      "p": [_nice(p) for p in probs]}, note="a few values")  # fmt: skip
    if values.ndim >= 1 and values.shape[-1] > 1 and lo >= 0.0:
        rows = values.reshape(-1, values.shape[-1]).astype(np.float64).sum(axis=-1)
        if np.allclose(rows, 1.0, atol=1e-4):
            return Recipe(kind="softmax", dtype=dtype, params={}, note="rows of a softmax of normal draws")
    n = f.size
    span = hi - lo
    kurt = float(((f - mean) ** 4).mean() / std**4) - 3.0 if std > 0 else 0.0
    if n >= 32 and abs(kurt + 1.2) < 0.35 and abs(std - span / math.sqrt(12)) < 0.15 * std:
        a, b = lo - span / n, hi + span / n  # unbiased ends of a uniform range
        bound = max(abs(a), abs(b))
        if abs(a + b) < 0.05 * span:
            for k in sorted(set(fan_ins)):
                if k > 0 and abs(bound * math.sqrt(k) - 1.0) < 0.03:
                    return Recipe(
                        kind="uniform",
                        dtype=dtype,
                        params={"low": -1 / math.sqrt(k), "high": 1 / math.sqrt(k), "fan_in": k},
                        fan_in_bound=True,  # fmt: skip
                        note="PyTorch's default init: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))",
                    )
        for ends in ((0.0, 1.0), (-1.0, 1.0)):
            if abs(a - ends[0]) < 0.02 * span and abs(b - ends[1]) < 0.02 * span:
                a, b = ends
        return Recipe(kind="uniform", dtype=dtype, params={"low": _nice(a), "high": _nice(b)}, note="uniform")
    kurt_band = max(0.5, 4 * math.sqrt(24 / n))  # the sample kurtosis' spread is about sqrt(24/n)
    if n >= 32 and abs(kurt) < kurt_band and abs(mean) < 4 * std / math.sqrt(n) + 1e-3 * std:
        s = 1.0 if abs(std - 1.0) < 4 * std / math.sqrt(2 * n) else _nice(std)
        return Recipe(kind="normal", dtype=dtype, params={"mean": 0.0, "std": s}, note="normal")
    return Recipe(kind="clipped_normal", dtype=dtype,
                  params={"mean": _nice(mean), "std": _nice(std), "low": _nice(lo), "high": _nice(hi)},
                  note="normal with the observed mean and spread, clipped to the observed range")  # fmt: skip


def at_scale(recipe: Recipe, shape: tuple[int, ...], weight_fan_in: int | None) -> dict[str, Any]:
    """The recipe's parameters at another scale: a fan-in bound is recomputed from that scale's shape."""
    params = dict(recipe.params)
    if recipe.fan_in_bound and weight_fan_in:
        b = 1.0 / math.sqrt(weight_fan_in)
        params.update(low=-b, high=b, fan_in=weight_fan_in)
    return params


def draw_code(name: str, recipe: Recipe, key: str, spec: str) -> str:
    """One line of `get_inputs`: `name = <jax.random call>` reading shape and parameters from `spec`."""
    dt = f"jnp.{np.dtype(recipe.dtype).name}" if recipe.dtype != "bfloat16" else "jnp.bfloat16"
    shape = f'{spec}["shape"]'
    kind = recipe.kind
    if kind == "constant":
        code = f'jnp.full({shape}, {spec}["value"], {dt})'
    elif kind == "bool":
        code = f'jax.random.bernoulli({key}, {spec}["p"], {shape})'
    elif kind == "integers":
        code = f'jax.random.randint({key}, {shape}, {spec}["low"], {spec}["high"], {dt})'
    elif kind == "choice":
        code = (f'jax.random.choice({key}, jnp.asarray({spec}["values"], {dt}), {shape}, '
                f'p=jnp.asarray({spec}["p"]))')  # fmt: skip
    elif kind == "uniform":
        code = f'jax.random.uniform({key}, {shape}, {dt}, {spec}["low"], {spec}["high"])'
    elif kind == "normal":
        code = f'{spec}["mean"] + {spec}["std"] * jax.random.normal({key}, {shape}, {dt})'
    elif kind == "softmax":
        code = f"jax.nn.softmax(jax.random.normal({key}, {shape}, {dt}), axis=-1)"
    else:
        code = (f'jnp.clip({spec}["mean"] + {spec}["std"] * jax.random.normal({key}, {shape}, {dt}), '
                f'{spec}["low"], {spec}["high"])')  # fmt: skip
    return f"{name} = {code}  # {recipe.note}"
