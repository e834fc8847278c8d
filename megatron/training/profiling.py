"""--profile: profile iterations [--profile-step-start, --profile-step-end) of the --profile-ranks.

Iterations are numbered as in the log line (the first is 1): the defaults 10 and 12 profile
iterations 10 and 11. Two modes, as in Megatron-LM:

- ``--use-pytorch-profiler``: torch.profiler records the window (the iteration before it runs the
  profiler's warm-up, so that its start-up cost stays out of the record) and writes
  ``<dir>/rank<R>.<time ns>.pt.trace.json``, a Chrome trace JSON that Perfetto opens, named as
  TensorBoard's profiler plugin (torch-tb-profiler, not a dependency) looks for it, and beside it
  ``rank<R>.<time ns>.summary.txt``, the top operators by self device time (self CPU time on CPU).
  ``<dir>`` is --tensorboard-dir, else ``DEFAULT_PROFILE_DIR``.
- otherwise (CUDA only): the window is a CUDA profiler capture range with NVTX ranges for every
  operator, for ``nsys profile --capture-range=cudaProfilerApi``.

A run with --profile off, and every rank not in --profile-ranks, gets no profiler: zero cost.
"""

import time
from pathlib import Path

import torch

from megatron.training.training_log import print_rank_0, print_whole_line

DEFAULT_PROFILE_DIR = "profiler_output"
SUMMARY_ROWS = 30


def _window_text(first, last):
    return f"iteration {first}" if first == last else f"iterations {first}-{last}"


class TorchProfilerWindow:
    """torch.profiler over the profiled iterations of this rank; the trace is written when it stops."""

    def __init__(self, args, rank, directory):
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.rank = rank
        self.directory = directory
        self.on_gpu = args.device == "cuda"
        self.profiler = None
        self.first = self.last = None  # the iterations recorded

    def _begin_recording(self, iteration):
        # Started one iteration early when possible: the schedule's warm-up iteration absorbs the
        # profiler's start-up. A run resumed inside the window records the rest of it.
        self.first = max(iteration, self.start)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=int(iteration < self.start),
                                             active=self.end - self.first, repeat=1),
            on_trace_ready=self._write,
            # No Python stacks (Megatron-LM's with_stack=True): they multiply the host cost of a
            # host-bound step and the trace's size (4x on the tiny test model), and fill the
            # summary with Python frames instead of operators.
            record_shapes=True)
        self.profiler.start()

    def iteration_begin(self, iteration):
        if self.profiler is None:
            if self.start - 1 <= iteration < self.end:
                self._begin_recording(iteration)
        elif iteration < self.end:
            self.profiler.step()

    def iteration_end(self, iteration):
        if iteration == self.end - 1 and self.profiler is not None:
            self.close(iteration)

    def close(self, iteration):
        """Stop and write what was recorded; also called when training stops inside the window."""
        if self.profiler is not None:
            self.last = iteration
            self.profiler.stop()  # calls _write unless only the warm-up ran
            self.profiler = None

    def _write(self, profiler):
        self.directory.mkdir(parents=True, exist_ok=True)
        # Named as torch.profiler.tensorboard_trace_handler names traces (<worker>.<span>.pt.trace.json):
        # TensorBoard's profiler plugin lists them by worker, and a later run never overwrites one.
        stem = self.directory / f"rank{self.rank}.{time.time_ns()}"
        trace, summary = Path(f"{stem}.pt.trace.json"), Path(f"{stem}.summary.txt")
        profiler.export_chrome_trace(str(trace))
        sort_by, clock = ("self_device_time_total", "device") if self.on_gpu else ("self_cpu_time_total", "CPU")
        window = _window_text(self.first, self.last)
        summary.write_text(
            f"torch.profiler on rank {self.rank}, {window}: top operators by self {clock} time, "
            f"totals over the window\n"
            + profiler.key_averages().table(sort_by=sort_by, row_limit=SUMMARY_ROWS, max_name_column_width=70) + "\n")
        print_whole_line(f"rank {self.rank}: torch.profiler trace of {window} written to {trace} "
                         f"(Chrome trace JSON: open it in Perfetto); top operators in {summary}")


class CudaProfilerRange:
    """Megatron-LM's nsys mode: the profiled iterations are a CUDA profiler capture range with
    NVTX ranges for every operator (torch.autograd.profiler.emit_nvtx)."""

    def __init__(self, args):
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.nvtx = None  # the emit_nvtx context while the range is open

    def iteration_begin(self, iteration):
        if self.nvtx is None and self.start <= iteration < self.end:
            torch.cuda.cudart().cudaProfilerStart()
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.nvtx.__enter__()

    def iteration_end(self, iteration):
        if iteration == self.end - 1:
            self.close(iteration)

    def close(self, iteration):
        if self.nvtx is not None:
            self.nvtx.__exit__(None, None, None)
            torch.cuda.cudart().cudaProfilerStop()
            self.nvtx = None


def profile_directory(args):
    return Path(args.tensorboard_dir or DEFAULT_PROFILE_DIR)


def build_profiler(args):
    """This rank's profiler, or None when --profile is off or the rank is not profiled.
    Prints on rank 0 what is profiled and where it goes."""
    if not args.profile:
        return None
    window = _window_text(args.profile_step_start, args.profile_step_end - 1)
    if args.use_pytorch_profiler:
        print_rank_0(f"--profile: torch.profiler records {window} on ranks {args.profile_ranks}; "
                     f"traces go to {profile_directory(args).resolve()}/")
    else:
        print_rank_0(f"--profile: {window} on ranks {args.profile_ranks} form a CUDA profiler capture range: "
                     f"run under `nsys profile --capture-range=cudaProfilerApi`")
    rank = torch.distributed.get_rank()
    if rank not in args.profile_ranks:
        return None
    if args.use_pytorch_profiler:
        return TorchProfilerWindow(args, rank, profile_directory(args))
    return CudaProfilerRange(args)
