"""What the sandboxed analysis hands back: a program of kernels as plain data (code text and numbers).

The worker traces the reference and writes everything that depends on the jaxpr: kernel bodies, wrappers,
the glue between kernels. What depends only on a tile config — block-size constants, the VMEM figures in
the docstring, the tuning space — is computed on the agent side from these models, so rendering another
config needs no sandbox and no JAX.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class DimRef(BaseModel):
    """One dim of a block: a tunable block size (min(param, extent) at run time), the whole extent, or 1."""

    kind: Literal["param", "full", "unit"]
    param: str | None = None
    extent: int = 1
    align: int = Field(1, description="the param's alignment: the generated `_block` picks blocks with it")
    chunk: int | None = Field(
        None,
        description="rows a body walks this block in (`_row_chunks`): a block it divides and exceeds counts as "
        "one chunk of it (a temporary of the chunk, not of the block)",
    )

    def size(self, values: dict[str, int]) -> int:
        if self.kind == "unit":
            return 1
        if self.kind == "full":
            n = self.extent
        else:
            assert self.param is not None
            n = block_for(self.extent, values[self.param], self.align)
        return chunk_rows(n, self.chunk) if self.chunk else n


def chunk_rows(rows: int, chunk: int) -> int:
    """Rows one step of `_row_chunks` covers: `chunk` where it divides a larger block, else the whole block.

    Generated modules carry this very function as `_chunk_rows` (render.ROW_CHUNKS_HELPER)."""
    return chunk if rows > chunk and rows % chunk == 0 else rows


def block_for(extent: int, target: int, align: int) -> int:
    """Block size along one dim: the whole dim when it fits the target, else a divisor of the dim that is a
    multiple of `align` and at least half the target, else the target (and the dim gets padded).

    Generated modules carry this very function as `_block` (render.HELPERS), so the block a kernel picks at
    run time and the one the tuner's figures assume are the same."""
    if extent <= target:
        return extent
    b = (target // align) * align
    while b >= max(align, target // 2):
        if extent % b == 0:
            return b
        b -= align
    return target


class GridAxis(BaseModel):
    name: str = Field(description="index name in the index maps, e.g. 'm_index'")
    extent: int = Field(description="extent of the dim it walks, at the task's own (TPU) shapes")
    param: str | None = Field(None, description="block param; None: one grid step per element (squeezed)")
    semantics: Literal["parallel", "arbitrary"] = "parallel"
    align: int = Field(1, description="the param's alignment: the generated `_block` picks blocks with it")

    def steps(self, values: dict[str, int]) -> int:
        if self.param is None:
            return self.extent
        b = block_for(self.extent, values[self.param], self.align)
        return -(-self.extent // b)


class BufferSpec(BaseModel):
    """A VMEM buffer: a pipelined block of an operand (double-buffered) or a scratch / temporary."""

    what: str
    dims: list[DimRef]
    itemsize: int
    copies: int = Field(2, description="2 for pipelined inputs/outputs (double buffering), 1 for scratch")
    kind: Literal["input", "output", "scratch", "temporary", "compiler"] = Field(
        "input", description="compiler: room Mosaic takes for itself (vmem_limit_bytes, not the tile budget)"
    )
    axes: list[int] = Field(default_factory=list, description="grid axes that move this block (operands)")
    hbm_bytes: int = Field(0, description="size of the whole operand in HBM at the task's own shapes")

    def block_bytes(self, values: dict[str, int]) -> int:
        """Bytes of one block as laid out in VMEM: the last dim padded to 128 lanes and the one before to
        the sublane tile (8 rows of 32-bit, 16 of 16-bit, 32 of 8-bit), as Mosaic stores them."""
        sizes = [d.size(values) for d in self.dims]
        if sizes:
            sizes[-1] = -(-sizes[-1] // 128) * 128
        if len(sizes) >= 2:
            sub = {1: 32, 2: 16}.get(self.itemsize, 8)
            sizes[-2] = -(-sizes[-2] // sub) * sub
        n = self.itemsize
        for s in sizes:
            n *= s
        return n

    def hbm_block_bytes(self, values: dict[str, int]) -> int:
        """Bytes one block moves over HBM (no layout padding)."""
        n = self.itemsize
        for d in self.dims:
            n *= d.size(values)
        return n

    def vmem_bytes(self, values: dict[str, int]) -> int:
        return self.copies * self.block_bytes(values)


class ParamSpec(BaseModel):
    name: str = Field(description="the constant's name in the kernel module, e.g. BLOCK_M")
    role: Literal["sublane", "lane", "leading"]
    align: int = Field(description="block sizes must be multiples of this (or cover the whole dim)")
    extent: int = Field(description="largest extent of the dim it blocks, at the task's own shapes")
    default: int
    doc: str


class KernelSpec(BaseModel):
    name: str = Field(description="function name stem, e.g. _matmul_0")
    family: str
    title: str = Field(description="what this kernel computes, one line")
    code: str = Field(description="index maps, kernel body and wrapper, rendered against the constants")
    params: list[ParamSpec]
    grid: list[GridAxis]
    buffers: list[BufferSpec]
    flops: float = 0.0
    mxu_passes: int = Field(1, description="bf16 MXU passes per matmul flop (6 for f32 dots at HIGHEST)")
    transcendentals: float = 0.0
    row_group: int = Field(
        1,
        description="query heads folded into each block against one K/V block (grouped-query attention): "
        "every row tile is this many times taller, so the default VMEM target is this many times larger",
    )
    notes: list[str] = Field(default_factory=list, description="why the kernel looks the way it does")
    structure: str = Field("", description="the kernel's structure in a sentence or two, for the plan")


class ProgramSpec(BaseModel):
    """A generated program: the kernels and the `computation` that calls them."""

    task_id: str = ""
    family: str
    summary: str
    arg_names: list[str]
    n_dynamic: int
    computation_code: str = Field(description="the `computation` function, calling the kernel wrappers")
    kernels: list[KernelSpec]
    ops: list[str] = Field(default_factory=list, description="what the reference does, op by op (short)")
    inputs: list[str] = Field(default_factory=list, description="input specs at the task's own shapes")
    outputs: list[str] = Field(default_factory=list)
    glue: list[str] = Field(default_factory=list, description="layout work left to XLA between kernels")
    options: dict[str, bool] = Field(default_factory=dict, description="fusion options the analysis used")
