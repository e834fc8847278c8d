"""A plugin that raises in the training loop: --fail-at-iteration N stops the run with an error."""


class FailingPlugin:
    def add_arguments(self, parser):
        parser.add_argument("--fail-at-iteration", type=int, default=None)

    def is_enabled(self, args):
        return args.fail_at_iteration is not None

    def on_iteration_end(self, args, iteration, metrics):
        if iteration == args.fail_at_iteration:
            raise RuntimeError(f"failing_plugin: failed at iteration {iteration}")


PLUGIN = FailingPlugin()
