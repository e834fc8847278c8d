"""Progress lines of training and evaluation, in Megatron-LM's format, printed by the last rank.

The last rank holds the loss (last pipeline stage). Losses stay on the device between log lines:
one ``.item()`` per log interval, not per iteration. With --tensorboard-dir the same values also
go to TensorBoard (``tensorboard_log.py``).
"""

import math
import resource
import sys
import time

import torch

from megatron.training.host_memory import resident_bytes


def print_whole_line(message, stream=None):
    """One line from any rank, in one write, on ``stream`` (stdout unless given): ranks share their launcher's
    streams, and print() writes the text and its newline separately (unbuffered, as launches run), so two ranks'
    lines could join into one."""
    stream = sys.stdout if stream is None else stream
    stream.write(message + "\n")
    stream.flush()


def print_rank_0(message):
    if torch.distributed.get_rank() == 0:
        print_whole_line(message)


def is_last_rank():
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def print_last_rank(message):
    if is_last_rank():
        print_whole_line(message)


def peak_memory(device):
    """(log-line label, TensorBoard tag, bytes) of this process's peak memory so far. On the host, this process
    image's peak (host_memory.py); getrusage's only where /proc does not tell (not Linux), since an exec'd rank
    inherits that one from whatever forked its launcher (a test runner holding a model, say)."""
    if device == "cuda":
        return "peak memory (MB)", "mem-max-allocated-bytes", torch.cuda.max_memory_allocated()
    peak = resident_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return "peak host RSS (MB)", "peak-host-rss-bytes", peak


def perplexity(loss):
    return math.exp(min(20.0, loss))  # capped: an early loss would overflow


class TrainingLog:
    """Accumulates per-iteration results and prints one line every ``--log-interval``."""

    def __init__(self, args, flops_per_iteration, tensorboard=None):
        self.args = args
        self.tensorboard = tensorboard  # a TensorBoardLog on the last rank with --tensorboard-dir, else None
        self.flops_per_iteration = flops_per_iteration
        self.window_start = time.time()
        self.window_iterations = 0
        self.skipped = 0
        self.loss_sums = {}
        self.grad_norm = None
        self.learning_rate = 0.0

    def record(self, iteration, losses, grad_norm, skipped, learning_rate):
        """``losses`` may be device tensors: they are summed there and read once per line."""
        self.window_iterations += 1
        self.learning_rate = learning_rate
        self.skipped += int(bool(skipped))
        for name, value in losses.items():
            self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value
        self.grad_norm = grad_norm
        if self.tensorboard is not None:
            self.tensorboard.record_iteration(iteration, losses, grad_norm, learning_rate)
        if iteration % self.args.log_interval == 0:
            if is_last_rank():  # the others only start a new window: no host sync, no string work
                self._emit(iteration)
            self.window_start, self.window_iterations, self.skipped, self.loss_sums = time.time(), 0, 0, {}

    def _emit(self, iteration):
        args = self.args
        elapsed = time.time() - self.window_start
        per_iteration = elapsed / max(self.window_iterations, 1)
        tokens_per_s = args.global_batch_size * args.seq_length / per_iteration
        tflops_per_gpu = self.flops_per_iteration / per_iteration / args.world_size / 1e12
        memory_label, memory_tag, memory_bytes = peak_memory(args.device)
        averages = {name: float(total) / self.window_iterations for name, total in self.loss_sums.items()}
        parts = [
            f"iteration {iteration:8d}/{args.train_iters:8d}",
            f"consumed samples: {iteration * args.global_batch_size:12d}",
            f"elapsed time per iteration (ms): {per_iteration * 1000:.1f}",
            f"throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.3f}",
            f"tokens per second: {tokens_per_s:.0f}",
            f"learning rate: {self.learning_rate:.6E}",
            f"global batch size: {args.global_batch_size:5d}",
        ]
        parts += [f"{name}: {value:.6E}" for name, value in averages.items()]
        if self.grad_norm is not None:
            parts.append(f"grad norm: {self.grad_norm:.3f}")
        parts += [f"number of skipped iterations: {self.skipped:3d}", f"{memory_label}: {memory_bytes / 2**20:.0f}"]
        print_whole_line(" " + " | ".join(parts))
        if self.tensorboard is not None:
            self.tensorboard.write_log_line(iteration, {
                "iteration-time": per_iteration, "throughput": tflops_per_gpu, "tokens-per-second": tokens_per_s,
                "skipped-iterations": self.skipped, memory_tag: memory_bytes})


def log_evaluation(label, iteration, losses, tensorboard=None):
    parts = [f"{label} loss at iteration {iteration}"]
    for name, value in losses.items():
        parts.append(f"{name} value: {value:.6E} | {name} PPL: {perplexity(value):.6E}")
    line = " | ".join(parts)
    print_last_rank("-" * (len(line) + 1) + "\n " + line + "\n" + "-" * (len(line) + 1))
    if tensorboard is not None:
        tensorboard.write_evaluation(label, iteration, losses)
