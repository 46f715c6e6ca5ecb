"""Traces are captured for real in each test (tiny programs) and the parsed content is checked."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from maxkernel.tools.profile_trace import capture_trace, summarize_trace


def _add_tanh_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.tanh(x_ref[...] + y_ref[...])


def pallas_add_tanh(x, y):
    def index_map(i, j):
        return i, j

    spec = pl.BlockSpec((64, 128), index_map)
    out = pl.pallas_call(
        _add_tanh_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 64, x.shape[1] // 128),
        in_specs=[spec, spec],
        out_specs=spec,
        interpret=True,
    )(x, y)
    return out * 2.0


def xla_matmul(a, b):
    return jnp.tanh(a @ b) + 1.0


@pytest.fixture(scope="module")
def inputs():
    k1, k2 = jax.random.split(jax.random.key(0))
    return jax.random.normal(k1, (128, 256), jnp.float32), jax.random.normal(k2, (128, 256), jnp.float32)


def _check_common(summary, repeats: int) -> None:
    assert summary.kind == "measured"
    assert summary.platform == "cpu" and not summary.on_tpu
    assert summary.steps == repeats and len(summary.measured_step_us) == repeats
    assert summary.measured_wall_us > 0 and all(s > 0 for s in summary.measured_step_us)
    assert 0 < summary.measured_busy_us <= summary.measured_wall_us * 1.05
    assert summary.ops and all(op.measured_total_us > 0 and op.count >= 1 for op in summary.ops)
    assert summary.ops == sorted(summary.ops, key=lambda o: o.measured_total_us, reverse=True)
    assert sum(op.share for op in summary.ops) == pytest.approx(1.0, abs=1e-6)  # top_n covers all ops
    assert not summary.dma_sync_present and summary.measured_dma_sync_us == 0
    assert summary.measured_idle_gap_total_us >= summary.measured_idle_gap_max_us >= 0
    md = summary.to_markdown()
    assert "not TPU performance" in md and summary.device_label in md
    assert Path(summary.trace_path).name.endswith(".xplane.pb")
    assert summary.perfetto_trace_path and Path(summary.perfetto_trace_path).exists()


def test_xla_reference_trace(tmp_path: Path, inputs) -> None:
    a, b = inputs
    run_dir = capture_trace(xla_matmul, (a, b.T), tmp_path, label="reference", repeats=3)
    summary = summarize_trace(run_dir, label="reference", top_n=100)
    _check_common(summary, 3)
    assert summary.device_label == "cpu (XLA reference)"
    assert summary.kernel_share == 0 and summary.measured_kernel_us == 0
    sources = " ".join(op.source_op or "" for op in summary.ops)
    assert "dot_general" in sources  # the matmul is in the table, traced back to its JAX op
    assert all(op.count % 3 == 0 for op in summary.ops)  # each op ran once per traced step


def test_pallas_interpret_trace(tmp_path: Path, inputs) -> None:
    a, b = inputs
    run_dir = capture_trace(pallas_add_tanh, (a, b), tmp_path, label="candidate", repeats=2)
    summary = summarize_trace(run_dir, label="candidate", top_n=200)
    _check_common(summary, 2)
    assert summary.device_label == "cpu (Pallas interpret)"
    kernel_ops = [op for op in summary.ops if op.is_kernel]
    assert kernel_ops and any("pallas_call[_add_tanh_kernel]" in (op.source_op or "") for op in kernel_ops)
    assert any(not op.is_kernel for op in summary.ops)  # the `* 2.0` outside the kernel
    assert 0.3 < summary.kernel_share < 1.0
    assert summary.measured_kernel_us + summary.measured_non_kernel_us == pytest.approx(
        summary.measured_busy_us
    )
    # Grid (2, 2) loop body ran 4 times per step: some kernel instruction executed 4 x 2 times.
    assert max(op.count for op in kernel_ops) >= 8
    top = summarize_trace(run_dir, label="candidate", top_n=3)
    assert len(top.ops) == 3 and "more)" in top.to_markdown()


def test_summarize_synthetic_tpu_xplane(tmp_path: Path) -> None:
    """A TPU-shaped xplane (device plane with an 'XLA Ops' line) exercises the device path."""
    text = """
    planes {
      id: 1 name: "/device:TPU:0"
      lines {
        id: 1 name: "XLA Ops" timestamp_ns: 1000
        events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 stats { metadata_id: 10 str_value: "custom-call" } }
        events { metadata_id: 2 offset_ps: 6000000 duration_ps: 2000000 }
        events { metadata_id: 3 offset_ps: 9000000 duration_ps: 1000000 }
      }
      event_metadata { key: 1 value { id: 1 name: "matmul_kernel.3" } }
      event_metadata { key: 2 value { id: 2 name: "dma-wait.1" } }
      event_metadata { key: 3 value { id: 3 name: "fusion.2" } }
      stat_metadata { key: 10 value { id: 10 name: "hlo_category" } }
    }
    """
    f = tmp_path / "synthetic.xplane.pb"
    f.write_bytes(jax.profiler.ProfileData.text_proto_to_serialized_xspace(text))
    s = summarize_trace(f, label="tpu")
    assert s.on_tpu and s.platform == "tpu" and s.device_label.startswith("tpu")
    assert s.measured_busy_us == pytest.approx(8.0)
    assert s.measured_kernel_us == pytest.approx(5.0) and s.kernel_share == pytest.approx(5 / 8)
    assert s.dma_sync_present and s.measured_dma_sync_us == pytest.approx(2.0)
    assert s.measured_idle_gap_total_us == pytest.approx(2.0) and s.measured_idle_gap_max_us == pytest.approx(
        1.0
    )
    assert s.measured_wall_us == pytest.approx(10.0)
    assert "not TPU performance" not in s.to_markdown()


def test_missing_trace_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        summarize_trace(tmp_path, label="none")
