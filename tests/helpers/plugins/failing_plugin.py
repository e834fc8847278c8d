"""A plugin that interrupts the training loop: --fail-at-iteration N stops the run with an error,
--sigterm-at-iteration N sends SIGTERM to its own process, as a scheduler's preemption would."""

import os
import signal


class FailingPlugin:
    def add_arguments(self, parser):
        parser.add_argument("--fail-at-iteration", type=int, default=None)
        parser.add_argument("--sigterm-at-iteration", type=int, default=None)

    def is_enabled(self, args):
        return args.fail_at_iteration is not None or args.sigterm_at_iteration is not None

    def on_iteration_end(self, context, iteration, metrics):
        args = context.args
        if iteration == args.fail_at_iteration:
            raise RuntimeError(f"failing_plugin: failed at iteration {iteration}")
        if iteration == args.sigterm_at_iteration:
            os.kill(os.getpid(), signal.SIGTERM)


PLUGIN = FailingPlugin()
