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
the CPU. The MoE all-to-all token dispatcher sees the same view, whose streams do nothing.
"""

from __future__ import annotations

import contextlib
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


class _CpuStream:
    """A CUDA stream's part that megatron's all-to-all token dispatcher uses (its device-to-host
    copies on a side stream): on the CPU everything is already on the host and in order."""

    def wait_stream(self, stream: object) -> None:
        pass

    def record_event(self) -> _CpuStream:
        return self

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


class _CpuCuda:
    """torch.cuda with current_device() = "cpu" and no-op streams; everything else is torch.cuda's."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def Stream(*args: object, **kwargs: object) -> _CpuStream:  # noqa: N802 (torch.cuda's name)
        return _CPU_STREAM

    @staticmethod
    def current_stream(*args: object) -> _CpuStream:
        return _CPU_STREAM

    @staticmethod
    def stream(s: object) -> contextlib.nullcontext:
        return contextlib.nullcontext()

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
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    # (the MoE token dispatcher: its side stream for device-to-host copies of the split sizes)
    mappings.torch = layers.torch = token_dispatcher.torch = _TorchOnCpu()


def _patch_moe_utils() -> None:
    """megatron's router gating reads `te_general_gemm`, which moe_utils defines only when Transformer
    Engine imports (a NameError without it): None selects its plain matmul. And the token dispatcher's
    split sizes become host lists as they do on a GPU."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    # the all-to-all's split sizes: megatron turns them into host lists only when they are on a GPU
    # (gloo's all_to_all_single takes a sequence of ints, not a tensor)
    def to_host(tensor: object, as_numpy: bool = False, record_stream: bool = False) -> object:
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _patch_uneven_collectives() -> None:
    """gloo's all_gather and reduce_scatter take equal parts only; megatron's MoE dispatcher under TP x
    SP gathers and reduce-scatters each rank's routed tokens, which differ in number. On the CPU: the
    gather pads every part to the largest and cuts the padding off, the reduce-scatter all-reduces the
    whole tensor and keeps this rank's part (same sums, more bytes: gloo has no uneven collectives)."""
    import megatron.core.tensor_parallel.mappings as mappings
    import torch.distributed as dist

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return list(torch.split(total, [int(n) for n in input_split_sizes]))[group.rank()].contiguous()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven


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
    _patch_moe_utils()
    _patch_uneven_collectives()
    torch.cuda.current_device = lambda: 0  # an int, mapped to the CPU by _CudaToCpu
    torch.cuda.synchronize = lambda *a, **k: None
    _CudaToCpu().__enter__()  # for the life of the process
    _applied = True
    return True
