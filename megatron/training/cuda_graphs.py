"""What the loop adds to megatron-core's local CUDA graphs of transformer layers.

megatron-core records each layer's forward and backward in the first iterations and replays them
afterwards. Once the graphs exist it replays the training forward for every call of a layer, also
under ``torch.no_grad()`` in eval mode: evaluation would then apply dropout. Evaluation therefore runs
the layers eagerly, by taking their graph managers away for its duration.
"""

import contextlib

GRAPH_MANAGER = "cudagraph_manager"  # the submodule through which megatron-core routes a layer's call


@contextlib.contextmanager
def layers_run_eagerly(model_chunks):
    graphed = [module for chunk in model_chunks for module in chunk.modules() if GRAPH_MANAGER in module._modules]
    managers = [module._modules.pop(GRAPH_MANAGER) for module in graphed]
    try:
        yield
    finally:
        for module, manager in zip(graphed, managers):
            module._modules[GRAPH_MANAGER] = manager
