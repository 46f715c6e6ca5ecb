"""Why a conversion stopped, as data: the construct, where it is in the user's file, and what to do.

One table (`ADVICE`) holds the advice per kind of refusal; every refusal names its construct.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

ADVICE: dict[str, str] = {
    "torch_op": "torchax has no JAX lowering for this op: write that line with other torch ops, or write the "
    "JAX reference by hand in the problem-dir format (reference.py + kernel_task.yaml)",
    "jax_primitive": "the JAX source writer has no entry for this primitive yet (one function and one row in "
    "maxkernel/convert/jax_source.py WRITERS); until then, write the JAX reference by hand",
    "data_dependent": "forward branches on a tensor's value (`if x.sum() > 0`, `.item()`, `.tolist()`): a traced "
    "program has one path; use torch.where or masks instead",
    "randomness": "forward draws random numbers (torch.rand*, a functional dropout): a reference must be a "
    "function of its inputs; draw them in get_inputs and pass them in (nn.Dropout modules are removed)",
    "captured_constant": "forward uses a tensor that is neither an input nor a registered parameter/buffer: "
    "register it with `self.register_buffer(...)` so it becomes an input of the JAX reference",
    "output_type": "forward must return a tensor or a tuple/list of tensors",
    "input_type": "get_inputs must return tensors (and plain numbers, which become static arguments)",
    "entry_points": "a PyTorch task file defines an nn.Module (`Model`, or name it with --module), `get_inputs()` "
    "and, when the constructor takes arguments, `get_init_inputs()`",
    "task_code": "the file itself fails to run (see the message); fix the file and convert again",
    "machine": "the conversion ran past this machine's limits (its time or its memory), which says nothing about "
    "the file: convert it again with a longer --timeout, on a less loaded machine, or on one with more memory",
    "sizes": "sizes differ between the traced scales in a way the writer cannot express; keep the sizes in "
    "module-level constants (`batch_size = 128`) so a smaller copy of the task can be built, or make the "
    "model's shapes follow its inputs",
    "too_large": "the task's own inputs are too large to verify here and its sizes are not module-level "
    "constants that a smaller copy could change; move the sizes into module-level constants",
    "scales": "the model computes something different at smaller sizes (it branches on shapes), so no smaller "
    "copy of it can be verified here; keep shape-dependent branches out of forward",
    "mismatch": "the JAX reference and PyTorch disagree past the tolerance on the same inputs and weights; "
    "the report names the output and, where it could, the first op that differs",
    "framework": "the file is neither a PyTorch module file nor a CUDA/Triton kernel the model path takes",
}


class Refusal(BaseModel):
    kind: str = Field(description="a key of ADVICE")
    what: str = Field(description="the op, primitive or construct, by name")
    where: str = Field("", description="file:line and the line's text, when known")
    detail: str = ""

    @property
    def advice(self) -> str:
        return ADVICE.get(self.kind, "")

    def message(self) -> str:
        loc = f" at {self.where}" if self.where else ""
        detail = f" ({self.detail})" if self.detail else ""
        return f"cannot convert {self.what}{loc}{detail}: {self.advice}"


class ConversionRefused(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message())
        self.refusal = refusal
