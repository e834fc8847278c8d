"""What the loop adds to megatron-core's local CUDA graphs of transformer layers.

megatron-core records each layer's forward and backward in the first iterations and replays them
afterwards. Once the graphs exist it replays the training forward for every call of a layer, also
under ``torch.no_grad()`` in eval mode: evaluation would then apply dropout. Evaluation therefore runs
the layers eagerly, by taking their graph managers away for its duration.

At the end of a job every graph is released before the process groups are destroyed: NCCL cannot
destroy a communicator while a graph that captured one of its collectives (tensor parallelism's, a
pipeline's transfers) is alive, and the job would never exit.
"""

import contextlib
from typing import Any

import torch
from megatron.core.full_cuda_graph import FullCudaGraphWrapper
from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

from megatron.training.errors import ArgumentError

GRAPH_MANAGER = "cudagraph_manager"  # the submodule through which megatron-core routes a layer's call


def _graphed_modules(model_chunks):
    """The modules whose calls megatron-core routes through a graph manager."""
    return [module for chunk in model_chunks for module in chunk.modules()
            if module._modules.get(GRAPH_MANAGER) is not None]


@contextlib.contextmanager
def layers_run_eagerly(model_chunks):
    graphed = _graphed_modules(model_chunks)
    managers = [module._modules.pop(GRAPH_MANAGER) for module in graphed]
    try:
        yield
    finally:
        for module, manager in zip(graphed, managers):
            module._modules[GRAPH_MANAGER] = manager


def release_cuda_graphs(model_chunks=()):
    """Free every CUDA graph of the process and wait until the GPU has let go of them.

    megatron-core's ``delete_cuda_graphs()`` resets only the runners still on its global record, which it
    empties once the graphs are captured; the captured ones live on in each layer's graph manager, so those
    are reset here. A whole-iteration graph (``--cuda-graph-scope full_iteration``) is held by its wrapper."""
    for module in _graphed_modules(model_chunks):
        manager = module._modules[GRAPH_MANAGER]
        for runner in manager.cudagraph_runners:  # a runner may still be referenced from elsewhere: drop its graphs
            runner.fwd_graph = runner.bwd_graph = None
        manager.cudagraph_runners.clear()
    for stage in FullCudaGraphWrapper.cuda_graph:
        FullCudaGraphWrapper.cuda_graph[stage] = FullCudaGraphWrapper.result[stage] = None
    delete_cuda_graphs()  # megatron-core's own record and memory pool; it collects garbage and empties the cache
    torch.cuda.synchronize()


def graphs_give_way(args: Any, module_note: str, refusal: str) -> dict[str, str] | None:
    """For a plugin that cannot run with CUDA-graphed layers: the values its validation normalises. Graphs that
    were only the default give way (the start-up line says ``module_note``); graphs the user asked for are
    refused in one line (``refusal``). None when graphs are off anyway."""
    if args.cuda_graph_impl == "none":
        return None
    if not args.cuda_graph_by_default:
        raise ArgumentError(refusal)
    return {"cuda_graph_impl": "none", "cuda_graph_note": module_note}
