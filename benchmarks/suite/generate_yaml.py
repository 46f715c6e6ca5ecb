"""Regenerate every task's kernel_task.yaml (and this folder's README.md) from the task table below
and each task's reference.py.

    python benchmarks/suite/generate_yaml.py          # rewrite the files
    python benchmarks/suite/generate_yaml.py --check  # exit 1 if any is stale

`input_gen_code` is copied verbatim from `get_inputs` in reference.py, and the TPU-scale shapes in
each description are read off `jax.eval_shape`, so they cannot drift from the code. The
one-line summaries and the tolerances live in TASKS.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import pathlib
import sys

import jax
import yaml

SUITE = pathlib.Path(__file__).resolve().parent

# task_id: (summary, atol, rtol). The category is the prefix: op_ -> operator, fused_ -> fused.
TASKS: dict[str, tuple[str, float, float]] = {
    # ---- LLM / architecture operators -------------------------------------------------------
    "op_gemm_bf16": ("Plain GEMM C = A @ B in bfloat16 with float32 accumulation.", 2e-2, 2e-2),
    "op_matmul_unaligned_f32": (
        "Float32 matmul with every dimension off the 128 grid, so kernels must pad or mask.",
        1e-3,
        1e-3,
    ),
    "op_flash_attention_causal": (
        "Causal multi-head softmax attention over [batch, heads, seq, head_dim].",
        2e-2,
        2e-2,
    ),
    "op_attention_gqa": (
        "Causal grouped-query attention where groups of query heads share one key/value head.",
        2e-2,
        2e-2,
    ),
    "op_mla_attention": (
        "Causal multi-head latent attention (DeepSeek-V2): per-head keys and values are up-projected from a "
        "shared low-rank KV latent, plus a decoupled rotary key shared by all heads.",
        2e-2,
        2e-2,
    ),
    "op_sliding_window_attention": (
        "Causal sliding-window attention where each query sees only the last `window` keys.",
        2e-2,
        2e-2,
    ),
    "op_block_sparse_attention": (
        "Non-causal block-sparse attention selected by an int {0,1} mask over (query block, key block) tiles "
        "per head, diagonal tiles always kept.",
        2e-2,
        2e-2,
    ),
    "op_paged_attention_decode": (
        "Decode-step GQA attention over a paged KV cache addressed through an int page table, masked by "
        "per-sequence int lengths.",
        2e-2,
        2e-2,
    ),
    "op_ragged_attention_varlen": (
        "Causal attention over packed variable-length sequences given by int per-sequence lengths "
        "(attention never crosses a sequence boundary).",
        2e-2,
        2e-2,
    ),
    "op_attention_vit_unaligned": (
        "Bidirectional ViT attention with a sequence length that is not a multiple of 128.",
        2e-2,
        2e-2,
    ),
    "op_gated_mlp_swiglu": ("SwiGLU feed-forward down(silu(x @ W_gate) * (x @ W_up)).", 2e-2, 2e-2),
    "op_moe_topk_experts": (
        "Top-k mixture-of-experts layer: softmax router, top-k renormalised weights, SwiGLU experts run on "
        "their routed tokens (grouped matmuls), weighted combine.",
        2e-2,
        2e-2,
    ),
    "op_grouped_matmul": (
        "Grouped matmul: consecutive row groups of lhs (int group sizes, empty groups allowed) each multiply "
        "their own rhs[g].",
        2e-2,
        2e-2,
    ),
    "op_ragged_dot_tgmm": (
        "Ragged dot with a ragged contracting dimension (transposed grouped matmul, as in MoE weight "
        "gradients): out[g] = lhs[rows of g].T @ rhs[rows of g] in float32.",
        1e-2,
        1e-3,
    ),
    "op_rmsnorm": ("RMSNorm over the hidden dimension with a learned scale.", 2e-2, 2e-2),
    "op_layernorm_unaligned": (
        "Affine LayerNorm over a hidden size that is not a multiple of 128 (Falcon-7B's 4544).",
        1e-4,
        1e-4,
    ),
    "op_softmax_unaligned": (
        "Row softmax over a vocabulary-sized last axis that is not a multiple of 128 (GPT-2's 50257).",
        1e-6,
        1e-4,
    ),
    "op_cross_entropy_large_vocab": (
        "Per-token cross-entropy logsumexp(logits) - logits[label] over a 128k vocabulary with int labels.",
        1e-3,
        1e-4,
    ),
    "op_retention_parallel": (
        "RetNet multi-scale retention (decayed linear recurrence, gamma_h = 1 - 2^(-5-h)) in parallel form.",
        3e-2,
        3e-2,
    ),
    "op_ssd_chunked_scan": (
        "Mamba-2 SSD selective state-space scan (softplus dt, A = -exp(A_log), shared B/C, D skip) computed "
        "chunk by chunk.",
        1e-3,
        1e-3,
    ),
    "op_triangle_multiplication_outgoing": (
        "AlphaFold triangle multiplicative update (outgoing edges) on a pair representation: LayerNorm, "
        "gated projections, sum over k of a_ik * b_jk, LayerNorm, projection and sigmoid gate.",
        3e-2,
        3e-2,
    ),
    "op_rotary_embedding": (
        "Rotary position embedding (rotate-half convention) at int positions with base 500000.",
        2e-2,
        2e-2,
    ),
    "op_topk_gating": (
        "Top-k MoE gating: router logits, softmax over each token's top-k logits, dense [tokens, experts] "
        "gate matrix.",
        1e-3,
        1e-3,
    ),
    # ---- fused chains ---------------------------------------------------------------------------
    "fused_matmul_bias_gelu": ("Linear + bias + tanh-approximate GELU.", 2e-2, 2e-2),
    "fused_matmul_scale_residual_relu": ("relu(scale * (x @ w) + residual).", 1e-3, 1e-3),
    "fused_matmul_bias_leakyrelu_clamp": ("Linear + bias, leaky ReLU, clamp.", 1e-3, 1e-3),
    "fused_matmul_mish_tanh": ("tanh(mish(x @ w)).", 1e-3, 1e-3),
    "fused_matmul_bias_hardswish_rowsum": (
        "Linear + bias, hard-swish, sum over features (one float32 value per row).",
        1e-1,
        2e-3,
    ),
    "fused_matmul_bias_softmax": ("Linear + bias, softmax over output features.", 1e-6, 1e-3),
    "fused_matmul_scale_logsumexp": ("Row logsumexp of scale * (x @ w).", 1e-3, 1e-3),
    "fused_matmul_bias_rowmax_subtract_gelu": (
        "Linear + bias, subtract the row max, exact GELU.",
        2e-3,
        2e-2,
    ),
    "fused_matmul_batchnorm_relu": ("Linear, training-mode BatchNorm over the batch rows, ReLU.", 1e-3, 1e-3),
    "fused_matmul_bias_groupnorm_silu": (
        "Linear + bias, GroupNorm over contiguous feature groups, SiLU.",
        1e-3,
        1e-3,
    ),
    "fused_matmul_bias_layernorm_gelu": ("Linear + bias, LayerNorm, exact GELU.", 2e-2, 2e-2),
    "fused_matmul_bias_dropout_relu": (
        "Linear + bias, inverted dropout with a fixed key from a static seed, ReLU.",
        2e-2,
        2e-2,
    ),
    "fused_matmul_sigmoid_scale_residual": ("y = x @ w + b; scale * sigmoid(y) + y.", 1e-3, 1e-3),
    "fused_matmul_avgpool_gelu_scale_max": (
        "Linear, average-pool over feature groups, GELU, scale, row max.",
        1e-3,
        1e-3,
    ),
    "fused_bmm_scale_softmax": ("Batched matmul, scale, softmax over the last axis.", 2e-3, 2e-2),
    "fused_bmm_residual_layernorm": ("Batched matmul, residual add, LayerNorm.", 2e-2, 2e-2),
    "fused_bmm_tanh_max": ("Batched matmul, tanh, max over the row axis.", 1e-3, 1e-3),
    "fused_gemv_bias_mish_batch1": (
        "Batch-of-one linear layer (memory-bound GEMV) + bias + mish.",
        2e-2,
        2e-2,
    ),
    "fused_matmul_clamp_logsumexp": ("Linear, clamp, row logsumexp.", 1e-3, 1e-3),
    "fused_matmul_gelu_softmax": ("Linear, exact GELU, softmax over output features.", 1e-6, 1e-3),
    "fused_linear_cross_entropy": (
        "LM head matmul fused with per-token cross-entropy against int labels.",
        1e-3,
        1e-3,
    ),
    "fused_matmul_residual_rmsnorm": (
        "Output projection + residual add + RMSNorm with learned scale.",
        2e-2,
        2e-2,
    ),
    "fused_matmul_bias_sigmoid_colsum": (
        "Linear + bias, sigmoid, sum over the batch rows (column reduction).",
        1e-2,
        1e-3,
    ),
    "fused_matmul_hardtanh_gelu_dropout": (
        "Linear, hard-tanh, exact GELU, inverted dropout with a fixed key.",
        1e-3,
        1e-3,
    ),
    "fused_bmm_instancenorm_relu": (
        "Batched matmul, InstanceNorm1d over the length axis per channel, ReLU.",
        1e-3,
        1e-3,
    ),
    "fused_mlp_relu_residual": ("Two-layer ReLU MLP with biases and a residual add.", 2e-2, 2e-2),
    "fused_conv2d_batchnorm_relu": ("3x3 conv2d (NHWC), training-mode BatchNorm, ReLU.", 1e-3, 1e-3),
    "fused_conv2d_bias_groupnorm_silu": (
        "3x3 conv2d + bias (NHWC), 32-group GroupNorm, SiLU (UNet ResNet block).",
        2e-2,
        2e-2,
    ),
    "fused_conv2d_instancenorm_leakyrelu": (
        "3x3 conv2d (NHWC), InstanceNorm without affine, leaky ReLU.",
        1e-3,
        1e-3,
    ),
    "fused_conv2d_bias_hardswish_avgpool": (
        "3x3 conv2d + bias (NHWC), hard-swish, 2x2 average pool.",
        2e-2,
        2e-2,
    ),
    "fused_convnext_block": (
        "ConvNeXt block: 7x7 depthwise conv, LayerNorm, GELU MLP, layer scale, residual.",
        3e-2,
        3e-2,
    ),
    "fused_conv2d_bias_sigmoid_spatialsum": (
        "3x3 conv2d + bias (NHWC), sigmoid, sum over H and W.",
        1e-2,
        1e-3,
    ),
    "fused_conv2d_valid_scale_clamp_globalavgpool": (
        "3x3 conv2d with VALID padding, scale, clamp, global average pool.",
        5e-3,
        2e-2,
    ),
    "fused_conv3d_groupnorm_relu": ("3x3x3 conv3d (NDHWC), 8-group GroupNorm with affine, ReLU.", 1e-3, 1e-3),
    "fused_conv3d_bias_softmax_maxpool": (
        "3x3x3 conv3d + bias (NDHWC), softmax over channels, 2x2x2 max pool.",
        2e-3,
        2e-2,
    ),
    "fused_conv3d_batchnorm_hardtanh_avgpool": (
        "3x3x3 conv3d (NDHWC), training-mode BatchNorm, hard-tanh, 2x2x2 average pool.",
        1e-3,
        1e-3,
    ),
    "fused_patch_embed_layernorm": (
        "ViT patch embedding: 16x16 stride-16 conv2d on 3-channel images + bias, position embeddings, "
        "LayerNorm.",
        2e-2,
        2e-2,
    ),
    "fused_resnet_bottleneck": (
        "ResNet-50 bottleneck: 1x1/3x3/1x1 convs each with training-mode BatchNorm, ReLUs, identity "
        "residual.",
        3e-2,
        3e-2,
    ),
}

CATEGORY_OF_PREFIX = {"op": "operator", "fused": "fused"}

_SHORT_DTYPE = {
    "bfloat16": "bf16",
    "float32": "f32",
    "float16": "f16",
    "int32": "i32",
    "int8": "i8",
    "bool": "bool",
}


def category(task_id: str) -> str:
    return CATEGORY_OF_PREFIX[task_id.split("_", 1)[0]]


def load_reference(task_id: str):
    path = SUITE / task_id / "reference.py"
    spec = importlib.util.spec_from_file_location(f"maxkernel_suite_{task_id}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fmt_array(a) -> str:
    return f"{_SHORT_DTYPE.get(str(a.dtype), str(a.dtype))}[{','.join(str(d) for d in a.shape)}]"


def _fmt_static(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else repr(v)


def tpu_shapes(module) -> str:
    holder = {}

    def make():
        dyn, static = module.get_inputs(scale="tpu")
        holder["static"] = static
        return dyn

    dyn = jax.eval_shape(make)
    static = holder["static"]
    out = jax.eval_shape(lambda *d: module.computation(*d, *static), *dyn)
    names = list(inspect.signature(module.computation).parameters)
    parts = [f"{n} {_fmt_array(a)}" for n, a in zip(names, dyn, strict=False)]
    parts += [f"{n}={_fmt_static(v)}" for n, v in zip(names[len(dyn) :], static, strict=False)]
    outs = jax.tree_util.tree_leaves(out)
    return f"{', '.join(parts)} -> {', '.join(_fmt_array(o) for o in outs)}"


class _Dumper(yaml.SafeDumper):
    pass


def _str_presenter(dumper, data):
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_presenter)


def render_yaml(task_id: str, module) -> str:
    summary, atol, rtol = TASKS[task_id]
    doc = {
        "task_id": task_id,
        "description": f"{summary} TPU scale: {tpu_shapes(module)}.",
        "category": category(task_id),
        "input_gen_code": inspect.getsource(module.get_inputs),
        "atol": float(atol),
        "rtol": float(rtol),
    }
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=110, allow_unicode=False)


README_HEAD = """\
# maxkernel benchmark suite

Kernel-writing tasks for maxkernel, in the MaxKernel task format. Each task is a folder
`<task_id>/` holding:

- `reference.py`: `get_inputs(dtype=..., scale="tpu")` returns `(dynamic_args, static_args)`:
  a list of jax arrays drawn from fixed `jax.random.key(n)` seeds, and a list of plain
  JSON-serialisable values (may be empty). `computation(*dynamic_args, *static_args)` is the
  plain-JAX reference (jnp / lax / jax.nn only, no Pallas); every shape is read off its inputs.
- `kernel_task.yaml`: `task_id`, `description` (what it computes plus TPU-scale shapes),
  `category` (`operator` or `fused`), `input_gen_code` (the exact source of `get_inputs`),
  `atol`, `rtol`.

Conventions:

- `scale="tpu"` gives production sizes (mostly 0.1-3 GiB of inputs, matmuls around 1e11-1e12
  flops; memory-heavy references loop over batch or heads with `lax.map` so they stay runnable).
  `scale="cpu"` gives sizes a Pallas kernel in TPU interpret mode can verify on a CPU in seconds.
- CPU-scale dims are multiples of 8 and trailing dims multiples of 128 where the op allows,
  except the tasks flagged in the notes column below, which exercise padding and masking.
- Integer inputs (labels, page tables, lengths, group sizes, block masks) are drawn inside their
  valid ranges; float inputs are never all zero or constant, and every dynamic input changes
  the output (checked by `tests/test_suite_tasks.py`).
- bf16 tasks accumulate in float32 (`preferred_element_type`); float32 tasks use
  `Precision.HIGHEST`. Dropout uses `jax.random.bernoulli(jax.random.key(seed), ...)` with a
  static seed.
- Do not edit `kernel_task.yaml` by hand: change `reference.py` or the table in
  `generate_yaml.py`, then run `python benchmarks/suite/generate_yaml.py`.

"""

UNALIGNED = {
    "op_matmul_unaligned_f32": "unaligned: 250x300x1000 (CPU), 4000x5000x10000 (TPU)",
    "op_attention_vit_unaligned": "unaligned: seq 197 (CPU), 577 (TPU)",
    "op_layernorm_unaligned": "unaligned: hidden 568 (CPU), 4544 (TPU)",
    "op_softmax_unaligned": "unaligned: vocab 1000 (CPU), 50257 (TPU)",
    "op_cross_entropy_large_vocab": "unaligned: vocab 1000 (CPU)",
    "op_topk_gating": "narrow output: 16 (CPU) / 64 (TPU) experts",
    "op_mla_attention": "rope dim 32 (CPU) / 64 (TPU)",
    "fused_linear_cross_entropy": "unaligned: vocab 1003 (CPU)",
    "fused_gemv_bias_mish_batch1": "batch 1; unaligned N=1000 (CPU)",
    "fused_conv2d_valid_scale_clamp_globalavgpool": "VALID conv: output 16x16 (CPU), 54x54 (TPU)",
    "fused_patch_embed_layernorm": "3 input channels",
    "fused_conv3d_bias_softmax_maxpool": "narrow channels: 16->32 (CPU), 32->64 (TPU)",
    "fused_conv3d_groupnorm_relu": "narrow channels: 32 (CPU), 64 (TPU)",
    "fused_conv3d_batchnorm_hardtanh_avgpool": "narrow channels: 32 (CPU), 64 (TPU)",
}


def render_readme() -> str:
    lines = [README_HEAD]
    for cat, title in (("operator", "Operators"), ("fused", "Fused chains")):
        ids = [t for t in TASKS if category(t) == cat]
        lines.append(f"## {title} ({len(ids)})\n\n| task | what | notes |\n| --- | --- | --- |\n")
        for t in ids:
            note = UNALIGNED.get(t, "")
            lines.append(f"| `{t}` | {TASKS[t][0]} | {note} |\n")
        lines.append("\n")
    return "".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale files instead of writing")
    args = parser.parse_args(argv)
    on_disk = sorted(p.name for p in SUITE.iterdir() if (p / "reference.py").exists())
    missing = sorted(set(on_disk) ^ set(TASKS))
    if missing:
        print(f"task table and task folders disagree: {missing}", file=sys.stderr)
        return 1
    outputs = {SUITE / t / "kernel_task.yaml": render_yaml(t, load_reference(t)) for t in TASKS}
    outputs[SUITE / "README.md"] = render_readme()
    stale = [p for p, text in outputs.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"stale: {p.relative_to(SUITE)}", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(outputs[p])
    print(f"wrote {len(stale)} file(s) for {len(TASKS)} tasks")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read when the first backend starts, after import
    sys.exit(main())
