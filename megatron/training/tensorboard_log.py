"""--tensorboard-dir: the scalars of the log line as TensorBoard event files, written by the last rank.

Tags keep Megatron-LM's names where it has them:

- every --tensorboard-log-interval iterations: each reported loss (``lm loss``; that iteration's
  value, not the log line's average), ``learning-rate``, ``grad-norm``, ``batch-size``;
- at every log line (--log-interval): ``iteration-time`` (s), ``throughput`` (TFLOP/s per GPU),
  ``tokens-per-second``, ``skipped-iterations`` (in the log line's window) and the peak memory
  (``mem-max-allocated-bytes`` on GPU, ``peak-host-rss-bytes`` on CPU);
- at each evaluation: ``<loss> validation``, ``<loss> validation ppl``, ``<loss> test``, ``<loss> test ppl``.

Losses stay on the device until the next log line, which brings all pending ones to the host in
one transfer: TensorBoard adds no per-iteration host sync to the loop.
"""

import torch

from megatron.training.training_log import is_last_rank, perplexity, print_last_rank


class TensorBoardLog:
    def __init__(self, args):
        self.args = args
        self.writer = None  # created at the first write: a run that writes nothing leaves no file
        self.pending = []  # (iteration, {loss name: device tensor}, {tag: host value}) not yet written

    @classmethod
    def for_this_rank(cls, args):
        """The last rank's TensorBoard log (it holds the losses), or None: no --tensorboard-dir or another rank."""
        if not args.tensorboard_dir:
            return None
        print_last_rank(f"--tensorboard-dir: scalars go to {args.tensorboard_dir} "
                        f"(`tensorboard --logdir {args.tensorboard_dir}`)")
        return cls(args) if is_last_rank() else None

    def _writer(self):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where it writes

            self.writer = SummaryWriter(log_dir=self.args.tensorboard_dir, max_queue=self.args.tensorboard_queue_size)
        return self.writer

    def record_iteration(self, iteration, losses, grad_norm, learning_rate):
        """Keep this iteration's values (losses as device tensors) until the next log line."""
        if iteration % self.args.tensorboard_log_interval:
            return
        scalars = {"learning-rate": learning_rate, "batch-size": self.args.global_batch_size}
        if grad_norm is not None:
            scalars["grad-norm"] = grad_norm
        self.pending.append((iteration, losses, scalars))

    def _write_pending(self):
        loss_tensors = [value.detach().float().reshape(())
                        for _, losses, _ in self.pending for value in losses.values()]
        loss_values = iter(torch.stack(loss_tensors).tolist() if loss_tensors else [])  # the one transfer
        writer = self._writer()
        for iteration, losses, scalars in self.pending:
            for name in losses:
                writer.add_scalar(name, next(loss_values), iteration)
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, iteration)
        self.pending = []

    def write_log_line(self, iteration, window_scalars):
        """At a log line: the pending per-iteration values and the window's ``{tag: value}``."""
        self._write_pending()
        for tag, value in window_scalars.items():
            self.writer.add_scalar(tag, value, iteration)

    def write_evaluation(self, label, iteration, losses):
        writer = self._writer()
        for name, value in losses.items():
            writer.add_scalar(f"{name} {label}", value, iteration)
            writer.add_scalar(f"{name} {label} ppl", perplexity(value), iteration)

    def close(self):
        """Write what is pending (iterations after the last log line) and close the event file."""
        if self.pending:
            self._write_pending()
        if self.writer is not None:
            self.writer.close()
