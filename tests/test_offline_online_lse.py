"""Cross-entropy over a long last axis, with and without the matmul that makes the logits: the offline author
walks the vocabulary as a sequential grid axis, keeps the running max, the rescaled sum of exp and (for
logits computed in the kernel) the label's logit in f32 VMEM scratch, and finishes at the last vocabulary
block, so no `[rows, vocab]` array leaves the kernel (before: the label's logit was a gather outside kernels, so a linear + cross-entropy wrote
its logits to HBM and read them back, 0.81x of XLA on v5e for the suite's fused_linear_cross_entropy).

Each case goes through the real harness (TPU interpret mode on 3 input sets, the Pallas check, AOT Mosaic
compile for v5e and v6e at the task's own shapes). The kernels are rendered with small vocabulary blocks, so
the CPU-scale inputs span several blocks and, for the unaligned vocabularies, end in a block that overhangs
the array (the padded columns must take no part in the max, the sum or the label's logit)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from offline_helpers import acceptance_options

from maxkernel.authors.base import AuthorContext, TileConfig
from maxkernel.authors.offline import OfflineAuthor
from maxkernel.tools.harness import evaluate
from maxkernel.tools.tasks import load_task

TPU = ["v5e", "v6e"]

HEADER = "import jax\nimport jax.numpy as jnp\nfrom jax import lax\n\n\n"

CROSS_ENTROPY = """
def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    t, v = {shapes}
    kx, kl = jax.random.split(jax.random.key(11))
    logits = (jax.random.normal(kx, (t, v), jnp.float32) * 3.0).astype(dtype)
    labels = jax.random.randint(kl, (t,), 0, v, jnp.int32)
    return [logits, labels], []

def computation(logits, labels):
    lf = logits.astype(jnp.float32){scaled}
    m = jnp.max(lf, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(lf - m), axis=-1)) + m[:, 0]
    picked = jnp.take_along_axis(lf, labels[:, None], axis=-1)[:, 0]
    return lse - picked
"""

LINEAR_CROSS_ENTROPY = """
def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    t, d, v = {shapes}
    kh, kw, kl = jax.random.split(jax.random.key(12), 3)
    h = jax.random.normal(kh, (t, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (d, v), jnp.float32) * 2.0 * d**-0.5).astype(dtype)
    labels = jax.random.randint(kl, (t,), 0, v, jnp.int32)
    return [h, w, labels], []

def computation(h, w, labels):
    logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
    m = jnp.max(logits, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1)) + m[:, 0]
    picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return lse - picked
"""

LINEAR_LOGSUMEXP_F32 = """
def get_inputs(dtype=jnp.float32, scale="tpu"):
    t, d, v = {shapes}
    kh, kw, kl = jax.random.split(jax.random.key(13), 3)
    h = jax.random.normal(kh, (t, d), dtype)
    w = jax.random.normal(kw, (d, v), dtype) * 2.0 * d**-0.5
    labels = jax.random.randint(kl, (t,), 0, v, jnp.int32)
    return [h, w, labels], []

def computation(h, w, labels):
    logits = h @ w
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
"""

CASES = {
    # name: (reference, TPU-scale vs CPU-scale shapes, family, small blocks for the CPU-scale check)
    # logits with a temperature: computed in the kernel, so the label's logit is a masked sum there too
    "ce_scaled_unaligned": (
        CROSS_ENTROPY.replace("{scaled}", " * 0.5"),
        '(256, 100_003) if scale == "tpu" else (24, 2501)',
        "reduction",
        {"block_red": 512},
    ),
    # logits as given: the label's logit is one small gather of the bf16 input, read in place
    "ce_aligned": (
        CROSS_ENTROPY.replace("{scaled}", ""),
        '(256, 131_072) if scale == "tpu" else (16, 2048)',
        "reduction",
        {"block_red": 512},
    ),
    "linear_ce_unaligned": (
        LINEAR_CROSS_ENTROPY,
        '(512, 256, 50_257) if scale == "tpu" else (40, 136, 1003)',
        "matmul_online_reduce",
        {"block_n": 256, "block_k": 128},
    ),
    "linear_ce_aligned": (
        LINEAR_CROSS_ENTROPY,
        '(256, 512, 32_768) if scale == "tpu" else (32, 256, 1024)',
        "matmul_online_reduce",
        {"block_n": 256},
    ),
    # jax.nn.logsumexp shifts by where(isfinite(max), max, 0): rescaled online all the same
    "linear_logsumexp_f32": (
        LINEAR_LOGSUMEXP_F32,
        '(256, 384, 20_000) if scale == "tpu" else (24, 128, 700)',
        "matmul_online_reduce",
        {"block_n": 256},
    ),
}

PALLAS_OUTPUTS = """
import json, sys
import jax
import jax.numpy as jnp
from maxkernel.tools.estimate import estimate_pallas

ns = {}
exec(compile(open(sys.argv[1]).read(), "kernel", "exec"), ns)
specs = [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d)) for s, d in json.loads(sys.argv[2])]
est = estimate_pallas(jax.make_jaxpr(ns["computation"])(*specs), "v5e")
print(json.dumps([
    {"grid": list(c.grid), "outputs": [list(o.array_shape) for o in c.operands if o.role == "output"]}
    for c in est.pallas_calls
]))
"""


def _task(root: Path, name: str) -> Path:
    body, shapes, _, _ = CASES[name]
    d = root / name
    d.mkdir(parents=True)
    (d / "reference.py").write_text(HEADER + textwrap.dedent(body.format(shapes=shapes)).strip() + "\n")
    (d / "kernel_task.yaml").write_text(f"task_id: {name}\ndescription: {name}\natol: 1e-3\nrtol: 1e-3\n")
    return d


def _pallas_calls(src: str, specs: list[tuple[tuple[int, ...], str]], work: Path) -> list[dict]:
    """The kernel's pallas_calls at `specs` as the harness's block model sees them (grid, output shapes),
    read in a child process: generated code is not imported here."""
    path = work / "kernel_under_test.py"
    path.write_text(src)
    proc = subprocess.run(
        [sys.executable, "-c", PALLAS_OUTPUTS, str(path), json.dumps(specs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# linear_ce_aligned runs with `-m slow`: the same reference, family and checks as linear_ce_unaligned, whose
# vocabulary also ends in an overhanging block (the harder path); each case is a whole harness evaluation.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "linear_ce_aligned" else n for n in CASES]
)
def test_cross_entropy_streams_the_vocabulary_through_one_kernel(name: str, tmp_path: Path) -> None:
    _, _, family, small = CASES[name]
    task = load_task(_task(tmp_path / "tasks", name), work_dir=tmp_path)
    author = OfflineAuthor()
    ctx = AuthorContext(task=task, tpu=TPU, work_dir=tmp_path)
    plan = author.plan(ctx)
    assert plan.supported, plan.unsupported_reason
    assert plan.family == family
    values = plan.default_config.as_dict()
    values.update(small)
    src = author.render(ctx, plan, TileConfig.of(values)).source
    glue = src[src.index("def computation") :]
    if name == "ce_aligned":
        # a gather outside reads the few label logits of the bf16 input; no f32 copy of the logits
        assert "lax.gather(logits," in glue and "logits.astype(jnp.float32)" not in glue, glue
    else:
        # the logits exist only inside the kernel: their label's logit is a masked sum there, not a gather
        assert "gather" not in src, src

    result = evaluate(task, src, acceptance_options(TPU), work_dir=tmp_path)
    assert result.accepted, (result.error, src)
    assert result.uses_pallas and result.correct and len(result.correctness.sets) == 3
    assert all(result.tpu_compile[g].ok for g in TPU)

    # at the task's own shapes: one pallas_call, the vocabulary a grid axis of several steps, and nothing
    # vocabulary-sized written (one loss per row)
    specs = [(tuple(s.shape), str(s.dtype)) for s in task.configs[0].dynamic]
    rows, vocab = specs[0][0][0], specs[-2][0][-1]
    calls = _pallas_calls(src, specs, tmp_path)
    assert len(calls) == 1, calls
    (call,) = calls
    assert any(1 < n < vocab for n in call["grid"]), call  # the vocab loop is priced as grid steps
    for shape in call["outputs"]:
        n = 1
        for s in shape:
            n *= s
        assert n <= rows, (shape, call)
