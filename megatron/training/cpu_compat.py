"""Run megatron-core on CPU (gloo) by redirecting its hard-coded CUDA calls.

megatron-core allocates with ``device=torch.cuda.current_device()`` or ``device="cuda"``,
moves tensors with ``.cuda()``, forks the CUDA RNG for tensor-parallel dropout and checks
``tensor.type() == "torch.cuda.FloatTensor"`` in its optimizers. None of that has a switch,
so ``--device cpu`` installs, once per process and before any model is built:

* a ``TorchFunctionMode`` that rewrites every CUDA ``device=`` argument and ``.to("cuda")``
  to the CPU, and reports CPU tensor types under their CUDA names;
* ``torch.cuda`` stand-ins that have CPU twins in ``torch.cpu`` (streams, events,
  synchronize) or no meaning on CPU (memory statistics, ``set_device``);
* the tensor-parallel RNG tracker reading and writing the CPU generator, so that
  ``get_cuda_rng_tracker().fork()`` still gives model-parallel regions their own stream.

What does not work on CPU: fp16 (no loss-scaling kernels), transformer-engine,
CUDA graphs, fused kernels and NVML. Everything lives in this module so that the CUDA path
never sees it; nothing here edits megatron-core's files.
"""

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def _to_cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a CUDA ordinal, as returned by torch.cuda.current_device()
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Sends every tensor megatron-core places on "cuda" to the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Optimizers group parameters by 'torch.cuda.FloatTensor' etc.
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


def _patch_torch_cuda():
    cuda = torch.cuda
    cuda.is_available = lambda: False
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda *_: None
    cuda.device_count = lambda: 0
    cuda.synchronize = lambda *_, **__: None
    cuda.empty_cache = lambda: None
    cuda.Stream = torch.cpu.Stream
    cuda.Event = torch.cpu.Event
    cuda.current_stream = torch.cpu.current_stream
    cuda.default_stream = torch.cpu.current_stream
    cuda.stream = torch.cpu.stream
    cuda.nvtx.range_push = lambda *_, **__: None
    cuda.nvtx.range_pop = lambda *_, **__: None
    cuda.nvtx.range = lambda *_, **__: contextlib.nullcontext()
    cuda.get_rng_state = lambda *_, **__: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *_, **__: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it after seeding the CPU
    # No caching allocator on CPU: memory queries answer zero.
    cuda.max_memory_allocated = cuda.memory_allocated = lambda *_, **__: 0
    cuda.memory_stats = lambda *_, **__: {}
    torch.Tensor.cuda = lambda self, *_, **__: self


def _patch_rng_tracker():
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *_, **__: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *_, **__: torch.set_rng_state(state)
    # The tracker warns when the CPU stream moves inside a fork: on CPU the forked stream *is*
    # the CPU generator, and the fork restores it on exit.
    logging.getLogger(tp_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())


def install_cpu_compat():
    """Make megatron-core's CUDA calls land on the CPU for the rest of this process."""
    global _installed
    if _installed:
        return
    _patch_torch_cuda()
    _patch_rng_tracker()
    _CudaToCpuMode().__enter__()  # held for the whole process, by design
    _installed = True
