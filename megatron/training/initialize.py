"""Start the process group, the model-parallel groups and the random seeds."""

import datetime
import os
import random

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

from megatron.training.cpu_compat import install_cpu_compat
from megatron.training.save_lock import release_save_locks


def _use_deterministic_kernels():
    """--deterministic-mode. cuBLAS reads its workspace setting, and NCCL its algorithm, when they start, so
    the environment is set before either does; a setting the user gave is kept."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)


def _init_process_group(args, plugin_start=None):
    # A plugin may start the group over part of the launched processes; it goes first because it may
    # change this process's settings (MegaFBD's forward instances: device, tensor-parallel size).
    started_by_plugin = plugin_start is not None and plugin_start(args)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        install_cpu_compat()
    if not started_by_plugin and not torch.distributed.is_initialized():
        # A plain `python pretrain_gpt.py` is a one-process job, as under torchrun.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        torch.distributed.init_process_group(
            backend=args.distributed_backend,
            world_size=args.world_size,
            rank=int(os.environ.get("RANK", "0")),
            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
        )


def set_random_seed(seed, cuda_graphs=False):
    """Same seeds as Megatron-LM: each pipeline stage its own, tensor-parallel regions forked.

    CUDA graphs replay dropout only from a graph-safe generator state (``cuda_graphs``)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs)


def initialize_megatron(args, plugin_start=None):
    """``plugin_start(args) -> bool``: a plugin's start of torch.distributed (see plugins.py)."""
    if args.deterministic_mode:
        _use_deterministic_kernels()
    _init_process_group(args, plugin_start)
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


def shutdown():
    if torch.cuda.is_initialized():
        # A captured graph (megatron-core's local CUDA graphs) holds the NCCL communicators of the collectives
        # inside it (tensor parallelism's): a TP2 job on two H100s never returned from destroying their group.
        delete_cuda_graphs()
    if torch.distributed.is_initialized():
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    release_save_locks()  # the job's saves are done (the exit would release it too)
