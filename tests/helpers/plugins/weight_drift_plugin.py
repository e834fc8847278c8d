"""A plugin that changes the weights of the forward instances behind the weight transfer's back:
--drift-weights-at-iteration N adds 1e-3 to one weight of every MegaFBD forward instance after its
forward of iteration N, as a broken transfer or a stray write would; the forward copies then differ
from the backward ones, which MegaFBD's next checksum must catch."""

import torch


class WeightDriftPlugin:
    def __init__(self):
        self.model = None

    def add_arguments(self, parser):
        parser.add_argument("--drift-weights-at-iteration", type=int, default=None)

    def is_enabled(self, args):
        return args.drift_weights_at_iteration is not None

    def after_setup(self, context, model, optimizer, scheduler):
        self.model = model

    @torch.no_grad()
    def on_iteration_end(self, context, iteration, metrics):
        if iteration == context.args.drift_weights_at_iteration and context.placement.world.kind == "forward":
            next(self.model[0].parameters()).view(-1)[0] += 1e-3


PLUGIN = WeightDriftPlugin()
