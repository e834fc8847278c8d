"""MegaFBD's flags and every check of how they fit the launch and the other flags."""

from megafbd.layout import BACKWARD, FORWARD, InstanceLayout
from megatron.training.cuda_graphs import graphs_give_way
from megatron.training.errors import ArgumentError
from megatron.training.frozen_args import FrozenArgs
from megatron.training.placement import Launch, Placement, World


def add_arguments(parser):
    group = parser.add_argument_group("MegaFBD (forward/backward disaggregation)")
    group.add_argument("--forward-backward-disaggregating", action="store_true",
                       help="run forward and backward as separate instances: each (stage, data-parallel replica) "
                            "gets forward instances that stream microbatches without keeping activations and "
                            "backward instances that recompute, run the backward and own the optimizer")
    group.add_argument("--ignore-forward-tensor-parallel", action="store_true",
                       help="one forward process per stage and replica (TP1) serves the TP backward processes")
    group.add_argument("--fbd-forward-device", choices=["cuda", "cpu"], default=None,
                       help="device of the forward instances (default: --device); cpu talks to GPU "
                            "backward instances over gloo")
    group.add_argument("--fbd-weight-staleness", type=int, choices=[0, 1], default=0,
                       help="0: the forward of iteration i+1 waits for the weights of step i (the losses of "
                            "a normal run); 1: it uses the weights one step older while they travel "
                            "(not loss-equivalent)")
    group.add_argument("--fbd-checksum-interval", type=int, default=10,
                       help="compare the forward and backward copies of the weights by checksum every N "
                            "iterations (and at the end)")


def is_requested(args):
    return (args.forward_backward_disaggregating or args.ignore_forward_tensor_parallel
            or args.fbd_forward_device is not None or args.fbd_weight_staleness != 0)


def forward_tensor_size(args):
    return 1 if args.ignore_forward_tensor_parallel else args.tensor_model_parallel_size


def backward_world_size(args, launched):
    """How many of the ``launched`` processes are backward instances; one line if the count does not fit."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        return launched  # the layout check names the flag
    forward_tp = forward_tensor_size(args)
    per_replica = InstanceLayout.processes_per_replica(tp, pp, forward_tp)
    layout = InstanceLayout.for_launch(tp, pp, forward_tp, launched)
    if layout is None:
        forward_note = " (--ignore-forward-tensor-parallel)" if args.ignore_forward_tensor_parallel else ""
        raise ArgumentError(
            f"--forward-backward-disaggregating at TP{tp} x PP{pp} needs {per_replica} processes per "
            f"data-parallel replica ({tp * pp} backward + {forward_tp * pp} forward{forward_note}) but "
            f"{launched} were launched; launch a multiple of {per_replica} (e.g. {2 * per_replica} for DP2)")
    return layout.backward_size


def _require(condition, message):
    if not condition:
        raise ArgumentError(message)


def validate_args(args: FrozenArgs) -> dict[str, object]:
    """Check the flags; the values validation normalises (the forward instances' device, CUDA graphs off)."""
    _require(args.forward_backward_disaggregating,
             "--ignore-forward-tensor-parallel, --fbd-forward-device and --fbd-weight-staleness need "
             "--forward-backward-disaggregating")
    _require(args.virtual_pipeline_model_parallel_size is None,
             "--forward-backward-disaggregating does not support a virtual pipeline; drop "
             "--num-layers-per-virtual-pipeline-stage")
    _require(not getattr(args, "use_dpp", False),
             "--forward-backward-disaggregating cannot be combined with --use-dpp (each brings its own "
             "pipeline schedule); use one of them")
    _require(not args.overlap_param_gather,
             "--forward-backward-disaggregating cannot be combined with --overlap-param-gather (the forward "
             "instances need the updated weights right after the step); drop --overlap-param-gather")
    _require(args.fbd_checksum_interval >= 1, "--fbd-checksum-interval must be >= 1")
    forward_device = args.device if args.fbd_forward_device is None else args.fbd_forward_device
    _require(forward_device == "cpu" or args.device == "cuda",
             "--fbd-forward-device cuda needs --device cuda; use --fbd-forward-device cpu")
    _require(not (forward_device == "cpu" and args.fp16),
             "--fbd-forward-device cpu cannot run --fp16 (no CPU kernels); use --bf16")
    # The layers' graphs are captured around megatron-core's schedules, not the backward instances'.
    graphs = graphs_give_way(args, "off with --forward-backward-disaggregating",
                             f"--forward-backward-disaggregating cannot replay CUDA graphs (--cuda-graph-impl "
                             f"{args.cuda_graph_impl}); drop it")
    return {"fbd_forward_device": forward_device, **(graphs or {})}


def placement(args: FrozenArgs, launch: Launch) -> Placement:
    """The launch as MegaFBD lays it out (layout.py): the backward instances, a world that trains as the
    flags say, then the forward instances, a world that serves it at its own tensor-parallel size and
    device (no sequence parallelism at TP1)."""
    layout = InstanceLayout.for_launch(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                       forward_tensor_size(args), launch.size)
    backward = World(BACKWARD, 0, layout.backward_size, layout.tensor, args.sequence_parallel, args.device)
    forward = World(FORWARD, layout.backward_size, layout.forward_size, layout.forward_tensor,
                    args.sequence_parallel and layout.forward_tensor > 1, args.fbd_forward_device, trains=False)
    return Placement(launch.rank, (backward, forward))
