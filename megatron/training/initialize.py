"""Start the process group, the model-parallel groups and the random seeds."""

import datetime
import os
import random

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

from megatron.training.cpu_compat import install_cpu_compat
from megatron.training.cuda_graphs import release_cuda_graphs
from megatron.training.job_lifetime import watch_helpers
from megatron.training.peer_watch import start_peer_watch
from megatron.training.placement import Launch
from megatron.training.save_dir.lock import release_save_locks


def _use_deterministic_kernels():
    """--deterministic-mode. cuBLAS reads its workspace setting, and NCCL its algorithm, when they start, so
    the environment is set before either does; a setting the user gave is kept."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)


def open_launch_store(args) -> torch.distributed.Store:
    """The key-value store every process of the launch shares (torchrun's rendezvous store; a plain
    ``python pretrain_gpt.py`` is a one-process launch, as under torchrun, that hosts its own)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    launch = Launch.from_environment()
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    store, _, _ = next(torch.distributed.rendezvous("env://", launch.rank, launch.size, timeout=timeout))
    store.set_timeout(timeout)
    return store


def _init_process_group(args, plugin_start=None, store=None):
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        install_cpu_compat()
    # A plugin may start the group over part of the launched processes (its world of a placement).
    if (plugin_start is not None and plugin_start()) or torch.distributed.is_initialized():
        return
    # As init_process_group's own env:// start, on the launch's store (opened here unless the caller did).
    store = open_launch_store(args) if store is None else store
    torch.distributed.init_process_group(
        backend=args.distributed_backend, world_size=args.world_size, rank=int(os.environ.get("RANK", "0")),
        timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
        store=torch.distributed.PrefixStore("default_pg", store))


def set_random_seed(seed, cuda_graphs=False):
    """Same seeds as Megatron-LM: each pipeline stage its own, tensor-parallel regions forked.

    CUDA graphs replay dropout only from a graph-safe generator state (``cuda_graphs``)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs)


def initialize_megatron(args, plugin_start=None, store=None):
    """``plugin_start() -> bool``: a plugin's start of torch.distributed (see plugins.py); ``store``: the
    launch's store (``open_launch_store``) when the caller opened it, else the plain start opens its own."""
    if args.deterministic_mode:
        _use_deterministic_kernels()
    start_peer_watch()  # before the group: a rank that dies during its start is named too
    watch_helpers()
    _init_process_group(args, plugin_start, store)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        # the model-parallel groups' own timeout (megatron-core's default is 30 minutes), as Megatron-LM passes it
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    init_num_microbatches_calculator(
        rank=torch.distributed.get_rank(),
        rampup_batch_size=None,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        data_parallel_size=args.data_parallel_size,
    )
    set_random_seed(args.seed, cuda_graphs=args.cuda_graph_impl == "local")


def shutdown(model_chunks=()):
    """End the job's distributed state. ``model_chunks``: the model whose CUDA graphs to release first (see
    ``release_cuda_graphs``: a graph that captured a collective keeps its communicator from being destroyed)."""
    if torch.cuda.is_initialized():
        release_cuda_graphs(model_chunks)
    if torch.distributed.is_initialized():
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    release_save_locks()  # the job's saves are done (the exit would release it too)
