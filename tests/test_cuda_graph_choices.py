"""The CUDA-graph and pipeline-transfer settings a run's flags give megatron-core, and the plugins that make default
graphs give way. The graphs themselves run on GPUs only: `bench/gpu_layout_losses.sh` checks their losses against
one GPU and their exit at every layout."""

import pytest

from megadpp.arguments import validate_args as validate_dpp_args
from megascope.plugin import MegaScopePlugin
from megatron.training.arguments import parse_args
from megatron.training.core_configs import ddp_config, transformer_config
from megatron.training.cuda_graphs import graphs_give_way
from megatron.training.errors import ArgumentError
from megatron.training.plugins import PluginRegistry
from megatron.training.validate_args import validate_args

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--train-iters", "3", "--mock-data", "--vocab-size", "1000", "--device", "cpu"]


def _validated(*flags, world_size=2):
    registry = PluginRegistry.discover()
    args = parse_args(MODEL + list(flags), "test", registry.add_arguments)
    return validate_args(args, world_size)


def _as_on_a_gpu(args, impl="local", by_default=True):
    """What the loop's validation leaves on a GPU host: graphs on (by default, or asked for)."""
    args.cuda_graph_impl, args.cuda_graph_by_default = impl, by_default
    return args


def test_pipeline_transfers_skip_megatron_cores_device_sync_unless_asked_for():
    assert transformer_config(_validated("--pipeline-model-parallel-size", "2")).batch_p2p_sync is False
    assert transformer_config(_validated("--pipeline-model-parallel-size", "2", "--batch-p2p-sync")).batch_p2p_sync


def test_a_whole_iteration_graph_drops_the_host_syncs_it_cannot_capture():
    args = _as_on_a_gpu(_validated("--pipeline-model-parallel-size", "2", "--batch-p2p-sync"))
    assert ddp_config(args).check_for_nan_in_grad
    args.cuda_graph_scope = ["full_iteration"]
    assert transformer_config(args).batch_p2p_sync is False
    assert ddp_config(args).check_for_nan_in_grad is False


def test_default_graphs_give_way_to_a_plugin_and_asked_for_graphs_are_refused_in_one_line():
    assert graphs_give_way(_validated(), "off: why", "refused") is None  # CPU: no graphs to give way
    assert graphs_give_way(_as_on_a_gpu(_validated()), "off: why", "refused") == {
        "cuda_graph_impl": "none", "cuda_graph_note": "off: why"}
    with pytest.raises(ArgumentError, match="^refused$"):
        graphs_give_way(_as_on_a_gpu(_validated(), by_default=False), "off: why", "refused")


def test_the_dynamic_pipeline_schedule_turns_default_graphs_off_and_refuses_asked_for_ones():
    dpp = ("--pipeline-model-parallel-size", "2", "--use-dpp")
    assert validate_dpp_args(_as_on_a_gpu(_validated(*dpp))) == {
        "cuda_graph_impl": "none", "cuda_graph_note": "off with --use-dpp"}
    with pytest.raises(ArgumentError, match=r"^--use-dpp runs microbatches in a changing order, which the "
                                            r"per-microbatch CUDA graphs of --cuda-graph-impl local cannot follow"):
        validate_dpp_args(_as_on_a_gpu(_validated(*dpp), by_default=False))
    assert validate_dpp_args(_validated("--pipeline-model-parallel-size", "2")) is None


def test_megascope_training_turns_default_graphs_off():
    args = _as_on_a_gpu(_validated("--training-ws-port", "8765"))
    assert MegaScopePlugin().validate_args(args)["cuda_graph_impl"] == "none"
