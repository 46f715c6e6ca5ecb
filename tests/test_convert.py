"""The conversion's pure parts, without PyTorch: writing a traced JAX program back out as source (sizes
fitted across scales), the recipes read off draws, size constants read and rewritten as text, file kinds,
KernelBench suites and fast_p."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from maxkernel.convert import input_recipes, kernelbench, source_kind, torch_module  # noqa: E402
from maxkernel.convert.jax_source import SourceWriter, UnsupportedPrimitive  # noqa: E402
from maxkernel.convert.program import flatten_closed, structure_difference  # noqa: E402
from maxkernel.convert.shape_fit import SizeFitter  # noqa: E402


def _trace(fn, *shapes):
    return flatten_closed(jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)))


def _load(source: str):
    ns: dict = {}
    exec("import jax\nimport jax.numpy as jnp\nfrom jax import lax\n" + source, ns)
    return ns["computation"]


def mlp_mean(x, w, b):
    y = jax.nn.gelu(x @ w + b)
    y = y.reshape(y.shape[0], -1, 4).mean(axis=-1)  # a split whose constant (4) must not be mistaken
    return jax.nn.softmax(jnp.cumsum(y, axis=1), axis=-1), jnp.max(y, axis=0)


SCALES = [(256, 128, 64), (32, 16, 8), (64, 48, 24)]


def test_written_function_is_the_traced_program_at_every_scale():
    programs = [_trace(mlp_mean, (m, k), (k, n), (n,)) for m, k, n in SCALES]
    assert structure_difference(programs[0], programs[1]) is None
    source = SourceWriter(programs).write_function("computation", ["x", "w", "b"])
    assert "// 4" in source and "// 16" not in source  # the smallest constant that fits on three scales
    computation = jax.jit(_load(source))
    reference = jax.jit(mlp_mean)
    for m, k, n in [*SCALES, (128, 80, 16)]:  # a fourth, unseen scale too
        rng = np.random.default_rng(m)
        args = tuple(rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (n,)))
        for want, got in zip(reference(*args), computation(*args), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    again = _trace(_load(source), (256, 128), (128, 64), (64,))
    assert structure_difference(programs[0], again) is None


def test_a_mean_divisor_that_follows_the_sizes_is_written_as_a_shape_expression():
    fn = lambda x: jnp.mean(x, axis=(1, 2))  # noqa: E731 - the literal is H*W
    programs = [_trace(fn, s) for s in [(8, 64, 32), (8, 16, 8), (8, 32, 8)]]
    source = SourceWriter(programs).write_function("computation", ["x"])
    assert "2048" not in source and "x.shape[1] * x.shape[2]" in source
    x = jnp.arange(8 * 24 * 40, dtype=jnp.float32).reshape(8, 24, 40)
    np.testing.assert_allclose(_load(source)(x), fn(x), rtol=1e-6)


def test_scan_and_pooling_are_written_and_run():
    def fn(x):
        pooled = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2), (1, 2), "VALID")
        _, ys = lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(x.shape[1] // 2), pooled)
        return ys

    programs = [_trace(fn, s) for s in [(64, 256), (16, 32), (16, 64)]]
    source = SourceWriter(programs).write_function("computation", ["x"])
    assert "def scan_body_" in source and "lax.reduce_window(" in source
    x = np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32)
    np.testing.assert_allclose(_load(source)(x), fn(x), rtol=1e-6)
    assert structure_difference(programs[1], _trace(_load(source), (16, 32))) is None


def test_a_primitive_without_a_writer_is_refused_by_name():
    program = _trace(lambda a: lax.linalg.cholesky(a @ a.T + 4 * jnp.eye(a.shape[0])), (8, 8))
    with pytest.raises(UnsupportedPrimitive) as info:
        SourceWriter([program]).write_function("computation", ["a"])
    assert info.value.primitive == "cholesky"


def test_size_fitter_prefers_exact_then_products_and_refuses_what_does_not_fit():
    f = SizeFitter()
    f.add("x", [(128, 64, 32), (16, 8, 4), (32, 8, 8)])
    assert f.fit([128, 16, 32]) == "x.shape[0]"
    assert f.fit([64 * 32, 32, 64]) == "x.shape[1] * x.shape[2]"
    assert f.fit([256, 32, 64]) == "x.shape[0] * 2"
    assert f.fit([7, 7, 7]) == "7"
    assert f.fit([1000, 17, 3]) is None
    assert f.fit_number([1 / 2048, 1 / 32, 1 / 64]) == "1.0 / (x.shape[1] * x.shape[2])"


def test_recipes_tell_pytorch_distributions_apart():
    rng = np.random.default_rng(0)
    fan_in = 576
    bound = 1 / np.sqrt(fan_in)
    kaiming = input_recipes.recognise(
        rng.uniform(-bound, bound, (128, 64, 3, 3)).astype(np.float32), [fan_in]
    )
    assert kaiming.kind == "uniform" and kaiming.fan_in_bound
    assert input_recipes.at_scale(kaiming, (32, 16, 3, 3), 144)["high"] == pytest.approx(1 / 12)
    assert input_recipes.recognise(rng.random((64, 256)).astype(np.float32), []).params == {
        "low": 0.0,
        "high": 1.0,
    }
    assert input_recipes.recognise(rng.standard_normal((64, 256)).astype(np.float32), []).kind == "normal"
    assert input_recipes.recognise(np.ones((64,), np.float32), []).kind == "constant"
    labels = input_recipes.recognise(rng.integers(0, 10, (512,)).astype(np.int32), [])
    assert (labels.kind, labels.params) == ("integers", {"low": 0, "high": 10})
    signs = input_recipes.recognise(rng.choice([-1.0, 1.0], (512,)).astype(np.float32), [])
    assert signs.kind == "choice" and signs.params["values"] == [-1.0, 1.0]
    logits = rng.standard_normal((32, 100))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    assert input_recipes.recognise(probs.astype(np.float32), []).kind == "softmax"
    skewed = input_recipes.recognise(rng.exponential(2.0, (4096,)).astype(np.float32), [])
    assert skewed.kind == "clipped_normal" and skewed.params["low"] >= 0


SOURCE = """import torch
batch_size = 128
dim = 2048 * 2
input_shape = (4096,)
kernel_size = 3
bias_shape = (dim, 1)

class Model(torch.nn.Module):
    pass

def get_inputs():
    return [torch.rand(batch_size, dim)]

def get_init_inputs():
    return []
"""


def test_size_constants_are_read_and_rewritten_as_text():
    consts = torch_module.size_constants(SOURCE)
    assert consts == {"batch_size": 128, "dim": 4096, "input_shape[0]": 4096, "kernel_size": 3}
    assert torch_module.scalable(consts).keys() == {"batch_size", "dim", "input_shape[0]"}
    rewritten = torch_module.rewrite_constants(SOURCE, {"dim": 512, "input_shape[0]": 512, "batch_size": 16})
    ns: dict = {}
    exec(rewritten.replace("import torch", "").replace("torch.nn.Module", "object"), ns)
    assert (ns["dim"], ns["input_shape"], ns["batch_size"], ns["bias_shape"]) == (512, (512,), 16, (512, 1))
    assert torch_module.shrink_value(4096, 0.125) == 512 and torch_module.shrink_value(3, 0.1) == 3
    assert torch_module.shrink_value(100, 0.25) == 24  # rounded down to its grain (4)
    assert torch_module.is_kernelbench_source(SOURCE)


def test_file_kinds_and_kernelbench_levels(tmp_path):
    (tmp_path / "level1").mkdir()
    (tmp_path / "level1" / "2_b.py").write_text(SOURCE)
    (tmp_path / "level1" / "10_c.py").write_text(SOURCE)
    (tmp_path / "level1" / "notes.py").write_text("x = 1\n")
    assert [p.name for p in kernelbench.level_tasks(tmp_path / "level1")] == ["2_b.py", "10_c.py"]
    assert source_kind(tmp_path / "level1" / "2_b.py") == "pytorch"
    (tmp_path / "k.cu").write_text("__global__ void k() {}\n")
    (tmp_path / "t.py").write_text("import triton\n@triton.jit\ndef k(x): pass\n")
    (tmp_path / "ref.py").write_text("def get_inputs():\n    pass\ndef computation(x):\n    return x\n")
    assert [source_kind(tmp_path / n) for n in ("k.cu", "t.py", "ref.py")] == ["cuda", "triton", "task"]


def test_fast_p_counts_over_all_tasks():
    rows = [(True, 2.5), (True, 1.2), (True, 0.8), (False, None), (False, 3.0)]
    assert [kernelbench.fast_p(rows, p) for p in kernelbench.FAST_P] == [(3, 5), (2, 5), (1, 5), (1, 5)]
