"""How many vector-ALU and EUP operations the TPU compiler packs into one instruction bundle, per generation.

The block model prices elementwise work at `estimate.VALU_VREG_OPS_PER_CYCLE` vreg operations per EUP vreg
(its clock is the one the compiler's transcendental rate implies). That constant was an assumption (2) until
this script read it off the compiler's own instruction schedule: each probe is a Pallas kernel over a
512 x 1024 f32 block (512 vregs) whose body repeats one kind of operation N times per vreg, compiled ahead of
time for a TPU generation with libtpu's LLO dump on (`--xla_jf_dump_to`, `--xla_jf_dump_llo_text`); the
"schedule analysis" of the kernel's final bundles gives the bundle count. One bundle issues per cycle, so
operations / bundles is the issue rate the schedule reaches (the prologue, epilogue and the block's loads
and stores take the rest).

Read on libtpu 0.0.42.1 (figures in benchmarks/calibration_vpu_slots.md): v5e, v5p, v6e and 7x pack ~3.9 f32
multiply/add vreg ops per bundle (four vector-ALU slots) and one EUP op (exp) per bundle; v4 packs ~2 and
one EUP op every ~2 bundles. Per EUP vreg that is four VALU vreg ops on every generation.

Run: ``.venv/bin/python benchmarks/calibrate_vpu_slots.py [--tpu v4,v5e,v5p,v6e,7x] [--ops 16]``
Compile-only: nothing runs on a TPU, and nothing here is a measured time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

KINDS = {
    # name: (what one repetition does per element, VALU ops per repetition, EUP ops per repetition)
    "fma": ("y * 1.25 + 0.5 (f32)", 2, 0),
    "max": ("max(y, 0.25) - 0.125 (f32)", 2, 0),
    "exp": ("exp(y) * 0.5 (f32)", 1, 1),
    # the same over a bf16 block: what bf16 elementwise work costs per element against f32 (bf16_vpu_cost)
    "fma_bf16": ("y * 1.25 + 0.5 (bf16)", 2, 0),
    "exp_bf16": ("exp(y) * 0.5 (bf16)", 1, 1),
}
ROWS, COLS, STEPS = 512, 1024, 4
VREGS = ROWS * COLS // 1024


def _probe(gen: str, kind: str, ops: int, dump: Path) -> None:
    """Child process: compile one probe with the LLO dump on (the flags must be set before libtpu loads)."""
    os.environ["LIBTPU_INIT_ARGS"] = f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.sharding import SingleDeviceSharding

    from maxkernel.tools.estimate import topology_device

    dtype = jnp.bfloat16 if kind.endswith("_bf16") else jnp.float32
    kind = kind.removesuffix("_bf16")

    def body(x_ref, o_ref):
        y = x_ref[...]
        for _ in range(ops):
            if kind == "fma":
                y = y * 1.25 + 0.5
            elif kind == "max":
                y = jnp.maximum(y, 0.25) - 0.125
            else:
                y = jnp.exp(y) * 0.5
        o_ref[...] = y

    def f(x):
        spec = pl.BlockSpec((ROWS, COLS), lambda i: (i, 0))
        return pl.pallas_call(
            body,
            out_shape=jax.ShapeDtypeStruct((ROWS * STEPS, COLS), dtype),
            grid=(STEPS,),
            in_specs=[spec],
            out_specs=spec,
        )(x)

    device = topology_device(gen)
    x = jax.ShapeDtypeStruct((ROWS * STEPS, COLS), dtype, sharding=SingleDeviceSharding(device))
    jax.jit(f).lower(x).compile()


def _bundles(dump: Path) -> int | None:
    """Bundle count of the Pallas kernel's program (the largest final schedule in the dump)."""
    best = None
    for path in dump.glob("*schedule-analysis_final_bundles.txt"):
        text = path.read_text(errors="replace")
        m = re.search(r"total scheduled bundles:\s*(\d+)", text)
        if m and "tpu_custom_call" in text:
            n = int(m.group(1))
            best = n if best is None else max(best, n)
    return best


def measure(gen: str, kind: str, ops: int) -> dict[str, float | int | None]:
    with tempfile.TemporaryDirectory(prefix="vpu-slots-") as tmp:
        dump = Path(tmp)
        cmd = [sys.executable, __file__, "--child", gen, kind, str(ops), str(dump)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        bundles = _bundles(dump)
        if bundles is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"bundles": None, "error": tail[0][:200]}
    _, valu, eup = KINDS[kind]
    # the schedule is the kernel body's: one grid step (the grid loop runs it STEPS times)
    return {
        "bundles": bundles,
        "valu_per_bundle": valu * ops * VREGS / bundles,
        "eup_per_bundle": eup * ops * VREGS / bundles,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _probe(sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tpu", default="v4,v5e,v5p,v6e,7x")
    parser.add_argument("--ops", type=int, default=16, help="repetitions per element in each probe")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for gen in [g for g in args.tpu.split(",") if g]:
        for kind in KINDS:
            rows.append({"tpu": gen, "probe": kind, **measure(gen, kind, args.ops)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("<!-- produced by: .venv/bin/python benchmarks/calibrate_vpu_slots.py (compile-only, no TPU) -->")
    print("# Vector-unit issue rate in the TPU compiler's schedule (bundles of a Pallas kernel, AOT)")
    print()
    print(
        f"Each probe: one grid step over a {ROWS} x {COLS} block ({VREGS} f32 vregs' worth of elements), "
        f"{args.ops} repetitions per element; bundles from libtpu's final schedule analysis (one bundle issues "
        "per cycle). Ops per bundle are in f32 vregs' worth of elements, for bf16 probes too."
    )
    print()
    print("| TPU | probe | bundles | VALU vreg ops / bundle | EUP vreg ops / bundle |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r.get("bundles") is None:
            print(f"| {r['tpu']} | {KINDS[r['probe']][0]} | failed: {r.get('error')} | | |")
            continue
        print(
            f"| {r['tpu']} | {KINDS[r['probe']][0]} | {r['bundles']} | {r['valu_per_bundle']:.2f} | "
            f"{r['eup_per_bundle']:.2f} |"
        )
    bundles = {(r["tpu"], r["probe"]): r.get("bundles") for r in rows}
    print()
    print("bf16 against f32, same elements (`TpuSpec.bf16_valu_cost`, `TpuSpec.bf16_eup_cost`):")
    print()
    print("| TPU | bf16 / f32 bundles, y * 1.25 + 0.5 | bf16 / f32 bundles, exp(y) * 0.5 |")
    print("|---|---|---|")
    for gen in dict.fromkeys(r["tpu"] for r in rows):
        ratios = []
        for kind in ("fma", "exp"):
            a, b = bundles.get((gen, f"{kind}_bf16")), bundles.get((gen, kind))
            ratios.append(f"{a / b:.2f}" if a and b else "-")
        print(f"| {gen} | {ratios[0]} | {ratios[1]} |")


if __name__ == "__main__":
    main()
