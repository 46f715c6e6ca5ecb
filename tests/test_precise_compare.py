"""The correctness comparison for low-precision outputs: the reference rounds too, so the judge runs it once
more with its bf16 inputs widened to float32, and an element that misses the reference is still right when it
is as close to that run as the reference itself is (plus the tolerance), or, where the reference's rounding
cascades, within its worst rounding while the kernel as a whole is as close to that run as the reference. A
wrong element, or a kernel less precise throughout, stays wrong."""

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


def test_the_judges_widened_run_covers_low_precision_programs_only() -> None:
    want, exact = _case()
    assert exact.dtype == np.float32 and exact.shape == want[0].shape
    assert not np.array_equal(exact, want[0].astype(np.float32))  # the reference did round
    f32 = [np.ones((2, 2), np.float32)]
    assert _precise_outputs(jax.jit(lambda a: a * 2), [f32[0]], f32, 0, 0) == {}
    # a float32 output of a bf16 program carries its rounding: widened and step-wise runs are kept for it
    x = np.full((2, 2), 1.5, ml_dtypes.bfloat16)
    widen = jax.jit(lambda a: ((a + 256) - 256).astype(jnp.float32))
    kept = _precise_outputs(widen, [x], [np.asarray(widen(x))], 0, 0)
    assert kept["c0s0o0"].dtype == np.float32 and np.allclose(kept["c0s0o0"], 1.5)


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


# A bfloat16 SwiGLU block as a model writes it: every op rounds to bf16, as XLA does for the reference.
def _swiglu(x, g, u, d):
    return jnp.dot(jax.nn.silu(jnp.dot(x, g)) * jnp.dot(x, u), d)


def _blocked_dot(a, b, block=128):
    # an f32 accumulation over K in blocks, in the kernel's order rather than XLA's
    acc = jnp.zeros((a.shape[0], b.shape[1]), jnp.float32)
    for k in range(0, a.shape[1], block):
        acc = acc + jnp.dot(a[:, k : k + block], b[k : k + block], preferred_element_type=jnp.float32)
    return acc


def _kernel_like(x, g, u, d, *, epilogue_f32=False, narrow=None):
    a, b = _blocked_dot(x, g), _blocked_dot(x, u)
    if epilogue_f32:  # the epilogue kept in float32, rounded once before the second matmul
        h = (a * jax.nn.sigmoid(a) * b).astype(jnp.bfloat16)
    else:  # rounded after each op, as the reference is
        a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        h = (a16 * jax.nn.sigmoid(a16)) * b16
    if narrow is not None:  # a kernel that cuts precision: the hidden activations in a narrower type
        h = h.astype(narrow).astype(jnp.bfloat16)
    return _blocked_dot(h, d).astype(jnp.bfloat16)


def _swiglu_case():
    rng = np.random.default_rng(4)
    shapes = [(256, 512), (512, 1024), (512, 1024), (1024, 512)]
    args = [rng.normal(size=s).astype(ml_dtypes.bfloat16) for s in shapes]
    fn = jax.jit(_swiglu)
    want = [np.asarray(fn(*args))]
    return args, want, _precise_outputs(fn, args, want, 0, 0)["c0s0o0"]


SWIGLU_CFG = InputConfig(dynamic=[ArraySpec(shape=[256, 512], dtype="bfloat16")], atol=1e-2, rtol=1e-2)


def test_honest_bf16_chains_that_round_elsewhere_are_right() -> None:
    """The reference's rounding cascades: a last bit flipped by another accumulation order moves an output
    near zero by more than the tolerance, at a few elements; an epilogue kept in float32 is closer to the
    exact answer than the reference and misses it at many. Both are right."""
    args, want, exact = _swiglu_case()
    for kw in ({}, {"epilogue_f32": True}):
        got = [np.asarray(_kernel_like(*args, **kw))]
        tolerance_only = compare(got, want, SWIGLU_CFG, 0, 0, "random")
        assert not tolerance_only.ok and tolerance_only.mismatches > 0, kw  # the case must bite
        check = compare(got, want, SWIGLU_CFG, 0, 0, "random", [exact])
        assert check.ok, (kw, check.message)


def test_less_precise_or_wrong_bf16_chains_stay_wrong() -> None:
    args, want, exact = _swiglu_case()
    # precision cut throughout: the kernel is much further from the exact answer than the reference
    narrow = [np.asarray(_kernel_like(*args, narrow=ml_dtypes.float8_e5m2))]
    check = compare(narrow, want, SWIGLU_CFG, 0, 0, "random", [exact])
    assert not check.ok and "rounding allowance refused" in check.message, check.message
    # the hidden activations accumulated in bf16 over the second matmul's 1024 terms (no f32 accumulator)
    a, b = _blocked_dot(args[0], args[1]), _blocked_dot(args[0], args[2])
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    h = (a16 * jax.nn.sigmoid(a16)) * b16
    acc = jnp.zeros((h.shape[0], args[3].shape[1]), jnp.bfloat16)
    for k in range(h.shape[1]):
        acc = acc + h[:, k : k + 1] * args[3][k : k + 1, :]
    check = compare([np.asarray(acc)], want, SWIGLU_CFG, 0, 0, "random", [exact])
    assert not check.ok and "rounding allowance refused" in check.message, check.message
    # an honest kernel with three elements wrong beyond the reference's worst rounding
    got = np.array(_kernel_like(*args))
    worst = float(np.abs(want[0].astype(np.float64) - exact).max())
    for i in ((0, 0), (17, 300), (255, 511)):
        got[i] = ml_dtypes.bfloat16(float(exact[i]) + 2 * worst + 1.0)
    check = compare([got], want, SWIGLU_CFG, 0, 0, "random", [exact])
    assert not check.ok and check.mismatches >= 3 and "beyond the reference's worst rounding" in check.message


# A bf16 matmul, swish, bias and group norm (groups of 64 over 4096 features), as JAXBench's fused chains
# write it. XLA:CPU keeps the fused chain's bf16 intermediates in float32 (`xla_allow_excess_precision`),
# so its output is within half an ulp of the float32 run; a kernel that rounds after every op as the
# program says is several ulps off at elements the normalisation amplifies.
def _group_norm_chain(x, w, b):
    y = jax.nn.sigmoid(jnp.dot(x, w)) * jnp.dot(x, w) + b
    g = y.reshape(y.shape[0], y.shape[1] // 64, 64)
    out = (g - g.mean(-1, keepdims=True)) / jnp.sqrt(jnp.var(g, -1, keepdims=True) + 1e-5)
    return out.reshape(y.shape)


def _group_norm_case():
    rng = np.random.default_rng(2)
    args = [rng.uniform(size=(64, 1024)).astype(ml_dtypes.bfloat16),
            (rng.normal(size=(1024, 4096)) * 0.02).astype(ml_dtypes.bfloat16),
            (rng.normal(size=(4096,)) * 0.02).astype(ml_dtypes.bfloat16)]  # fmt: skip
    fn = jax.jit(_group_norm_chain)
    stepwise = jax.jit(_group_norm_chain, compiler_options={"xla_allow_excess_precision": False})
    want = [np.asarray(fn(*args))]
    runs = _precise_outputs(fn, args, want, 0, 0, stepwise)
    with jax.disable_jit():  # every op on its own, rounding to its dtype: a kernel that rounds as written
        got = np.asarray(_group_norm_chain(*args))
    return want, runs, got


def test_a_kernel_rounding_after_every_op_is_judged_against_the_stepwise_run_too() -> None:
    want, runs, got = _group_norm_case()
    assert sorted(runs) == ["c0s0o0", "c0s0o0r"]  # the stepwise run differs from the fused one here
    exact, stepwise = runs["c0s0o0"], runs["c0s0o0r"]
    assert stepwise.dtype == np.float32 and stepwise.shape == want[0].shape
    fused_only = compare([got], want, SWIGLU_CFG, 0, 0, "random", [exact])
    assert not fused_only.ok, "the case must bite: the fused reference alone refuses the honest kernel"
    check = compare([got], want, SWIGLU_CFG, 0, 0, "random", [exact], [stepwise])
    assert check.ok, check.message
    # the stepwise run is not a licence: wrong elements, or precision cut throughout, stay wrong
    wrong = got.copy()
    for i in ((0, 0), (31, 2049), (63, 4095)):
        wrong[i] = ml_dtypes.bfloat16(float(stepwise[i]) + 1.0)
    check = compare([wrong], want, SWIGLU_CFG, 0, 0, "random", [exact], [stepwise])
    assert not check.ok and "3 beyond the reference's worst rounding" in check.message, check.message
    narrow = got.astype(ml_dtypes.float8_e4m3fn).astype(ml_dtypes.bfloat16)
    assert not compare([narrow], want, SWIGLU_CFG, 0, 0, "random", [exact], [stepwise]).ok


def test_the_stepwise_run_is_kept_only_where_it_differs() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 128)).astype(ml_dtypes.bfloat16)
    double = jax.jit(lambda a: a * 2)  # one op: nothing to keep wider, the two runs agree
    strict = jax.jit(lambda a: a * 2, compiler_options={"xla_allow_excess_precision": False})
    assert sorted(_precise_outputs(double, [x], [np.asarray(double(x))], 0, 0, strict)) == ["c0s0o0"]


# The same chain ending in a float32 combine, as a mixture of experts weights its experts' bf16 outputs by
# float32 router probabilities: the output is float32, the rounding that decides it is the bf16 chain's.
def _combined(x, g, u, d, w):
    return _swiglu(x, g, u, d).astype(jnp.float32) * w


def test_a_float32_output_of_a_bf16_chain_gets_the_rounding_allowance() -> None:
    rng = np.random.default_rng(4)
    shapes = [(256, 512), (512, 1024), (512, 1024), (1024, 512)]
    args = [rng.normal(size=s).astype(ml_dtypes.bfloat16) for s in shapes]
    w = rng.uniform(0.5, 1.0, size=(1, 512)).astype(np.float32)
    fn = jax.jit(_combined)
    want = [np.asarray(fn(*args, w))]
    assert want[0].dtype == np.float32
    runs = _precise_outputs(fn, [*args, w], want, 0, 0, jax.jit(_combined))
    exact = runs["c0s0o0"]
    cfg = InputConfig(dynamic=[ArraySpec(shape=[256, 512], dtype="bfloat16")], atol=1e-2, rtol=1e-2)
    honest = [np.asarray(_kernel_like(*args, epilogue_f32=True).astype(jnp.float32) * w)]
    assert not compare(honest, want, cfg, 0, 0, "random").ok  # the case must bite
    check = compare(honest, want, cfg, 0, 0, "random", [exact])
    assert check.ok, check.message
    narrow = [np.asarray(_kernel_like(*args, narrow=ml_dtypes.float8_e5m2).astype(jnp.float32) * w)]
    check = compare(narrow, want, cfg, 0, 0, "random", [exact])
    assert not check.ok and "rounding allowance refused" in check.message, check.message
