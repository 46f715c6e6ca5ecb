"""The correctness comparison for low-precision outputs: the reference rounds too, so the judge runs it once
more with its bf16 inputs widened to float32, and an element that misses the reference is still right when it
is as close to that run as the reference itself is (plus the tolerance). A wrong element stays wrong."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from maxkernel.tools.evaluation import compare
from maxkernel.tools.judge import _precise_outputs
from maxkernel.tools.results import ArraySpec, InputConfig

CFG = InputConfig(dynamic=[ArraySpec(shape=[4, 64], dtype="bfloat16")], atol=2e-2, rtol=2e-2)


def _shifted(x, v):
    # (x + 256) - 256 in bf16 keeps x only to the nearest 2: the reference's own rounding, well past the
    # tolerance, which a kernel that adds in f32 does not share
    return ((x + jnp.asarray(256.0, x.dtype)) - jnp.asarray(256.0, x.dtype)) * v


def _case():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 64)).astype(ml_dtypes.bfloat16)
    v = np.ones((4, 64), ml_dtypes.bfloat16)
    fn = jax.jit(_shifted)
    want = [np.asarray(fn(x, v))]
    precise = _precise_outputs(fn, [x, v], want, 0, 0)
    return want, precise["c0s0o0"]


def test_the_judges_widened_run_covers_low_precision_outputs_only() -> None:
    want, exact = _case()
    assert exact.dtype == np.float32 and exact.shape == want[0].shape
    assert not np.array_equal(exact, want[0].astype(np.float32))  # the reference did round
    f32 = [np.ones((2, 2), np.float32)]
    assert _precise_outputs(jax.jit(lambda a: a * 2), [f32[0]], f32, 0, 0) == {}


def test_an_element_closer_to_the_exact_answer_than_the_reference_is_right() -> None:
    want, exact = _case()
    w = want[0].astype(np.float64)
    i = np.unravel_index(np.argmax(np.abs(w - exact)), w.shape)
    # a kernel that rounds elsewhere: equal to the exact answer, out of tolerance against the reference
    got = want[0].copy()
    got[i] = exact[i]
    tol = CFG.atol + CFG.rtol * abs(w[i])
    assert abs(float(exact[i]) - w[i]) > tol, "the case must put the reference's rounding past the tolerance"
    assert not compare([got], want, CFG, 0, 0, "random").ok
    assert compare([got], want, CFG, 0, 0, "random", [exact]).ok


def test_a_wrong_element_stays_wrong_with_the_exact_answer_at_hand() -> None:
    want, exact = _case()
    got = want[0].copy()
    got[1, 3] = ml_dtypes.bfloat16(float(want[0][1, 3]) + 1.0)
    check = compare([got], want, CFG, 0, 0, "random", [exact])
    assert not check.ok and check.mismatches == 1
    # a leaf without a widened run (an integer output, a failed run) is judged by the tolerance alone
    assert not compare([got], want, CFG, 0, 0, "random", [None]).ok
