"""A plugin that ends training through the contract: --stop-at-iteration N asks the loop to stop after
iteration N (twice, with two reasons: the loop logs the first one only), and records on rank 0 where
training ended (--stop-record FILE: the iteration on_train_end saw)."""

import torch


class StoppingPlugin:
    def add_arguments(self, parser):
        parser.add_argument("--stop-at-iteration", type=int, default=None)
        parser.add_argument("--stop-record", default=None)

    def is_enabled(self, args):
        return args.stop_at_iteration is not None

    def on_iteration_end(self, context, iteration, metrics):
        if iteration == context.args.stop_at_iteration:
            context.request_stop(f"stopping_plugin: stop at iteration {iteration}")
            context.request_stop("stopping_plugin: a second request")

    def on_train_end(self, context, iteration):
        if context.args.stop_record and torch.distributed.get_rank() == 0:
            with open(context.args.stop_record, "w") as record:
                record.write(f"{iteration} {context.stop_reason}")


PLUGIN = StoppingPlugin()
