"""From PyTorch (and, with a model, CUDA or Triton) to a JAX task the agent can write Pallas kernels for.

The rest of the code calls:

* `convert_torch_file(path, out_dir)` -> `ConversionResult`: a PyTorch file (KernelBench's format, or a named
  module with `get_inputs`) traced with torchax in a sandboxed child, written back as a standalone JAX
  `reference.py` + `kernel_task.yaml`, and verified against PyTorch (`torch_task`);
* `source_kind(path)`: what a file is (`task`, `pytorch`, `cuda`, `triton`, `unknown`), read as text;
* `kernelbench.is_level_dir(path)` / `kernelbench.fast_p(...)`: KernelBench suites and their metric.
"""

from maxkernel.convert.detect import source_kind
from maxkernel.convert.torch_task import ConversionResult, convert_torch_file, torch_available

__all__ = ["ConversionResult", "convert_torch_file", "source_kind", "torch_available"]
