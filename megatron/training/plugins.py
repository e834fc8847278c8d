"""The plugin contract of the training loop (see DESIGN.md) and the registry that holds the plugins.

A plugin is an object with any subset of these methods; the loop calls only what exists:

    add_arguments(parser)                 register flags (always called, so --help lists them)
    is_enabled(args) -> bool              a disabled plugin gets no further call: zero cost
    training_world_size(args, launched) -> int       how many of the launched processes form the
                                          training world (the others serve it, e.g. MegaFBD's forward
                                          instances); called before the flags are validated against it
    validate_args(args)                   check them; raise ArgumentError with one clear line
    start_process_group(args) -> bool     start torch.distributed for this process (over a subset of the
                                          launched processes) instead of the loop's plain start; may
                                          change per-process settings (device, sizes); True when it did
    run_process(args, job_parts) -> bool  run this process's whole job instead of the training loop
                                          (MegaFBD's forward instances); True when it did
    after_setup(args, model, optimizer, scheduler)   model and optimizer are built
    forward_backward_func(args) -> callable | None   supply the schedule of an iteration
    wrap_schedule(args, schedule) -> callable        wrap whichever schedule runs (tracing)
    on_iteration_begin(args, iteration)
    on_iteration_end(args, iteration, metrics)       metrics: losses, grad norm, skipped
    on_train_end(args, iteration)                    flush, stop servers, release memory

Plugins come from ``BUILTIN_PLUGIN_MODULES`` (the MegatronApp modules, imported when installed)
and from the ``MEGATRON_PLUGINS`` environment variable (comma-separated ``module`` or
``module:attribute`` import paths). A module provides its plugin as ``PLUGIN``.
"""

import importlib
import os

from megatron.training.errors import ArgumentError

BUILTIN_PLUGIN_MODULES = ("megascan", "megadpp", "megafbd", "megascope")
PLUGINS_ENV = "MEGATRON_PLUGINS"


def _import_plugin(path, required):
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if not required and error.name == module_name:
            return None
        raise ArgumentError(f"{PLUGINS_ENV}: cannot import plugin module {module_name!r} ({error})") from None
    plugin = getattr(module, attribute or "PLUGIN", None)
    if plugin is None:
        if not required:
            return None
        raise ArgumentError(f"{PLUGINS_ENV}: module {module_name!r} has no {attribute or 'PLUGIN'!r}")
    return plugin


class PluginRegistry:
    """Calls one hook on every enabled plugin, in registration order."""

    def __init__(self, plugins):
        self.plugins = list(plugins)
        self.enabled = []

    @classmethod
    def discover(cls, environ=os.environ):
        found = [_import_plugin(name, required=False) for name in BUILTIN_PLUGIN_MODULES]
        extra = [p.strip() for p in environ.get(PLUGINS_ENV, "").split(",") if p.strip()]
        found += [_import_plugin(name, required=True) for name in extra]
        return cls(p for p in found if p is not None)

    def add_arguments(self, parser):
        for plugin in self.plugins:
            if hasattr(plugin, "add_arguments"):
                plugin.add_arguments(parser)

    def select_enabled(self, args):
        self.enabled = [p for p in self.plugins if not hasattr(p, "is_enabled") or p.is_enabled(args)]

    def validate_args(self, args):
        self.select_enabled(args)
        self.call("validate_args", args)

    def training_world_size(self, args, launched):
        """The processes that train, of the ``launched`` ones (all of them unless a plugin keeps some)."""
        size = launched
        for plugin in self.enabled:
            if hasattr(plugin, "training_world_size"):
                size = plugin.training_world_size(args, size)
        return size

    def first_that_handles(self, hook, *args):
        """Call ``hook`` on each enabled plugin until one returns True (it did the work); whether one did."""
        return any(getattr(plugin, hook)(*args) for plugin in self.enabled if hasattr(plugin, hook))

    def call(self, hook, *args, **kwargs):
        for plugin in self.enabled:
            method = getattr(plugin, hook, None)
            if method is not None:
                method(*args, **kwargs)

    def forward_backward_func(self, args, default):
        """The schedule of an iteration: the one plugin that supplies one, else ``default``."""
        supplied = [(p, f) for p in self.enabled
                    if hasattr(p, "forward_backward_func") and (f := p.forward_backward_func(args)) is not None]
        if len(supplied) > 1:
            names = ", ".join(type(p).__name__ for p, _ in supplied)
            raise ArgumentError(f"two plugins each want to run the pipeline schedule ({names}); enable one")
        return supplied[0][1] if supplied else default

    def wrap_schedule(self, args, schedule):
        """Let every enabled plugin wrap the chosen schedule, in registration order (innermost first)."""
        for plugin in self.enabled:
            if hasattr(plugin, "wrap_schedule"):
                schedule = plugin.wrap_schedule(args, schedule)
        return schedule
