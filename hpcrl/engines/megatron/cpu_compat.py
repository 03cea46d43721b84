"""Let megatron-core 0.16 run on a CPU-only torch with gloo. Applied only when CUDA is absent;
on GPUs megatron runs as it is.

megatron-core assumes CUDA in a few places that matter for training on CPU:
- GlobalMemoryBuffer allocates its scratch tensors with device=current_device (CUDA);
- the tensor-parallel RNG tracker saves and restores the CUDA generator's state;
- the pipeline schedules and DDP helpers create tensors with device="cuda" or
  torch.cuda.current_device().
Each patch below replaces exactly one of these with its CPU equivalent.

The tensor factories are redirected by a torch function mode (`_CudaToCpu`), but a mode is off
while its own handler runs, and `torch.autograd.backward` goes through that handler: the backward
of megatron's autograd functions runs without it. Those that allocate there (the all-gathers and
reduce-scatters of sequence and context parallel) read `torch.cuda.current_device()` through their
module's `torch`, which `_patch_backward_devices` points at a view of torch whose current device is
the CPU.
"""

from __future__ import annotations

import operator
from functools import reduce

import torch
from torch.overrides import TorchFunctionMode

from hpcrl.engines import no_compile_on_cpu

_applied = False


def _patch_memory_buffer() -> None:
    import megatron.core.utils as mu

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        n = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype, device="cpu")
        return buf[:n].view(*tensor_shape)

    mu.GlobalMemoryBuffer.get_tensor = get_tensor


def _patch_rng() -> None:
    import megatron.core.tensor_parallel.random as mrand

    mrand._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrand._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    # the tracker seeds "the CUDA generator" per TP rank: on CPU that is the default generator
    torch.cuda.manual_seed = torch.manual_seed


class _CpuCuda:
    """torch.cuda with current_device() = "cpu"; everything else is torch.cuda's."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """The torch module as megatron's parallel layers see it: its `cuda` is `_CpuCuda`."""

    cuda = _CpuCuda()

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


def _patch_backward_devices() -> None:
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.tensor_parallel.mappings as mappings

    mappings.torch = layers.torch = _TorchOnCpu()


def _is_cuda_device(d: object) -> bool:
    if isinstance(d, int):
        return True  # what torch.cuda.current_device() returns
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, torch.device) and d.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Tensor factories asked for a CUDA device get the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # e.g. `weight.data.cuda()` when tying embeddings across stages
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]) and not isinstance(args[1], int):
            args = (args[0], "cpu", *args[2:])
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def apply_cpu_compat() -> bool:
    """Patch megatron-core for CPU if CUDA is absent. Idempotent; returns whether it applied."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    no_compile_on_cpu()
    _patch_memory_buffer()
    _patch_rng()
    _patch_backward_devices()
    torch.cuda.current_device = lambda: 0  # an int, mapped to the CPU by _CudaToCpu
    torch.cuda.synchronize = lambda *a, **k: None
    _CudaToCpu().__enter__()  # for the life of the process
    _applied = True
    return True
