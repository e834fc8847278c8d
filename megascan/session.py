"""One rank's tracing for a whole run: which iterations are traced, switching the tracers on and off
around them, and handing each closed window to the writer thread."""

import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.utils import get_model_config

from megascan.comm_tracer import CommTracer
from megascan.compute_tracer import OptimizerTracer, ScheduleTimers, ScheduleTracer
from megascan.layer_tracer import LayerTracer
from megascan.nvml_probe import NvmlProbe
from megascan.recorder import Recorder
from megascan.timing import make_timer
from megascan.trace_writer import TraceWriter
from megascan.traced_world import of as traced_world_of
from megascan.traced_world import shared_run_id
from megascan.transfer_recorder import TransferRecorder


def is_traced(iteration, interval, continuous):
    """The last ``continuous`` iterations (1-based) of every ``interval`` are traced."""
    return (iteration - 1) % interval >= interval - continuous


def trace_file_name(dp, pp, tp):
    return f"benchmark-data-{dp}-pipeline-{pp}-tensor-{tp}.json"


class TraceSession:
    def __init__(self, context, model_chunks, optimizer):
        args = context.args
        self.args = args
        self.context = context
        self.interval, self.continuous = args.trace_interval, args.continuous_trace_iterations
        self.recorder = Recorder(make_timer(args))
        self.config = get_model_config(model_chunks[0])
        self.schedule = ScheduleTracer(self.recorder, model_chunks)
        self.timers = ScheduleTimers(self.recorder)
        self.world = traced_world_of(context.placement)
        # What MegaDPP's transport and MegaFBD's coordinator report into the run's transfer-trace sink.
        self.transfers = TransferRecorder(self.recorder)
        context.transfer_trace.install(self.transfers)
        # Only a world with tensor parallelism has TP collectives to sample: elsewhere every op is recorded. By
        # default only GPUs sample: there a recorded collective costs the host what it needs to keep the GPU busy,
        # while on CPU the host is the device and sampling would only thin the evidence.
        requested = args.trace_tp_microbatches
        if requested is None:
            requested = 1 if args.device == "cuda" else 0
        self.tp_microbatches = requested if parallel_state.get_tensor_model_parallel_world_size() > 1 else 0
        self.switchable = [CommTracer(self.recorder, self.world, self.tp_microbatches), self.transfers]
        if optimizer is not None:  # a process that only runs forwards (MegaFBD's forward instances) has none
            self.switchable.append(OptimizerTracer(self.recorder, optimizer))
        if args.trace_granularity == "full":
            self.switchable.append(LayerTracer(self.recorder, model_chunks))
        self.iteration_start = None
        self.saved_timers = None  # config.timers outside traced iterations
        self.detection = None  # OnlineDetection with --trace-detect
        self.writer = self._open_writer(model_chunks)

    def _open_writer(self, model_chunks):
        args = self.args
        metadata = self._metadata(model_chunks)
        on_gpu = args.device == "cuda"
        device_index = metadata["device_index"]
        if args.trace_detect:
            # only a run that detects online loads detection
            from megascan.online_detection import OnlineDetection

            self.detection = OnlineDetection(args, metadata)
        probe = NvmlProbe.open(f"GPU-{torch.cuda.get_device_properties(device_index).uuid}") if on_gpu else None
        os.makedirs(args.trace_dir, exist_ok=True)
        path = os.path.join(args.trace_dir, trace_file_name(**metadata["coords"]))
        return TraceWriter(path, metadata, self.recorder, probe, device_index,
                           self.detection.summarize if self.detection else None)

    def _metadata(self, model_chunks):
        args = self.args
        world = self.world
        coords = {"dp": parallel_state.get_data_parallel_rank(),
                  "pp": parallel_state.get_pipeline_model_parallel_rank(),
                  "tp": parallel_state.get_tensor_model_parallel_rank() + world.tensor_offset}
        on_gpu = args.device == "cuda"
        device_index = torch.cuda.current_device() if on_gpu else None
        return {
            "type": "metadata", "format": "megascan", "version": 1,
            "run_id": shared_run_id(self.context.launch_store, self.context.placement),
            "rank": dist.get_rank() + world.rank_offset, "world_size": world.world_size, "coords": coords,
            # "training", or which world of a launch laid out by a plugin (MegaFBD: "backward", "forward")
            "instance_kind": self.context.placement.world.kind,
            "layout": {"dp": args.data_parallel_size, "pp": args.pipeline_model_parallel_size,
                       "tp": world.tensor_size, "vp": len(model_chunks),
                       "sequence_parallel": args.sequence_parallel,
                       "distributed_optimizer": args.use_distributed_optimizer,
                       "micro_batch_size": args.micro_batch_size,
                       "global_batch_size": args.global_batch_size,
                       "num_microbatches": get_num_microbatches()},
            "host": socket.gethostname(), "device": args.device, "device_index": device_index,
            "device_name": torch.cuda.get_device_name(device_index) if on_gpu else "cpu",
            "timer": self.recorder.timer.source, "granularity": args.trace_granularity,
            "tp_microbatches_recorded": self.tp_microbatches, "tp_microbatches_recorded_are": "last",
            "tp_backward_recorded": not self.tp_microbatches,
            "trace_interval": self.interval, "continuous_trace_iterations": self.continuous,
            "train_iters": args.train_iters}

    def wrap_schedule(self, schedule):
        return self.schedule.wrap(schedule)

    def iteration_begin(self, iteration):
        if not is_traced(iteration, self.interval, self.continuous):
            return
        recorder = self.recorder
        if recorder.window is None:
            last = ((iteration - 1) // self.interval + 1) * self.interval
            recorder.open_window((iteration - 1) // self.interval, list(range(iteration, last + 1)))
        recorder.window.traced.append(iteration)
        recorder.begin_iteration(iteration)
        for tracer in self.switchable:
            tracer.install()
        self.schedule.active = True
        self.saved_timers, self.config.timers = self.config.timers, self.timers
        self.iteration_start = recorder.timer.mark()

    def iteration_end(self, iteration):
        if self.iteration_start is None:
            return
        self.recorder.add_event("iteration", self.iteration_start, self.recorder.timer.mark())
        self.iteration_start = None
        self.config.timers = self.saved_timers
        self.schedule.active = False
        for tracer in self.switchable:
            tracer.uninstall()
        if iteration == self.recorder.window.iterations[-1]:
            window = self.recorder.close_window()
            self.writer.submit(window, complete=True)
            if self.detection is not None:
                self._judge_window(window.index, iteration)

    def _judge_window(self, window, iteration):
        alert = self.detection.evaluate(window)
        if alert is not None:  # every rank has the verdict: all stop after this iteration (saving with --save)
            self.context.request_stop(f"MegaScan: stopping training after iteration {iteration} (--trace-detect-exit)")

    def finish(self):
        if self.recorder.window is not None:
            self.writer.submit(self.recorder.close_window(), complete=False)
        self.writer.close()
