"""The plugin contract of the training loop (see docs/design.md) and the registry that holds the plugins.

Every hook is optional and is a protocol of its own (``AfterSetupHook``, ``IterationEndHook``, ...); ``Plugin``
is the protocol of all of them. A plugin class names the hooks it implements as its bases, so that the type
checker holds each method to its hook's signature; the registry finds, once, which enabled plugins implement a
hook (``isinstance`` against the hook's protocol) and calls the method itself: no hook is called by its name.

Plugins come from ``BUILTIN_PLUGIN_MODULES`` (the MegatronApp modules, imported when installed) and from the
``MEGATRON_PLUGINS`` environment variable (comma-separated ``module`` or ``module:attribute`` import paths).
A module provides its plugin as ``PLUGIN``.

The order of a run: the flags are parsed (``add_arguments``) and checked (``is_enabled``,
``training_world_size``, ``validate_args``, which may normalise values by returning them), a plugin
may declare a layout of its own (``placement``); then the loop freezes the configuration and makes the
``RunContext`` that every later hook receives: the read-only configuration (``context.args``, argparse's
names), the placement, ``request_stop(reason)`` and the transfer-trace sink. Nobody edits the
configuration afterwards (a write raises ``FrozenArgsError``). The hooks that run before the
context exists get argparse's namespace read-only.

Hooks are called in registration order (the built-in modules first: megascan, megadpp, megafbd,
megascope), so a tracer installs its recorder before the other plugins' ``after_setup`` runs.
"""

import argparse
import importlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from megatron.training.errors import ArgumentError
from megatron.training.frozen_args import FrozenArgs
from megatron.training.placement import Launch, Placement
from megatron.training.run_context import RunContext

BUILTIN_PLUGIN_MODULES = ("megascan", "megadpp", "megafbd", "megascope")
PLUGINS_ENV = "MEGATRON_PLUGINS"

# A pipeline schedule: megatron-core's forward_backward_func signature (forward_step_func=, data_iterator=,
# model=, num_microbatches=, seq_length=, micro_batch_size=, decoder_seq_length=, forward_only=) -> the
# losses each microbatch reported.
Schedule = Callable[..., list[Any]]


@runtime_checkable
class AddArgumentsHook(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Register the plugin's flags (always called, so that --help lists them)."""
        ...


@runtime_checkable
class IsEnabledHook(Protocol):
    def is_enabled(self, args: FrozenArgs) -> bool:
        """Whether the parsed flags ask for this plugin (before validation). A plugin without this hook is
        always enabled; one that is not enabled gets no later call: zero cost."""
        ...


@runtime_checkable
class TrainingWorldSizeHook(Protocol):
    def training_world_size(self, args: FrozenArgs, launched: int) -> int:
        """How many of the ``launched`` processes form the training world (the others serve it, e.g. MegaFBD's
        forward instances); the flags are validated against it. Raise ArgumentError when they cannot fit."""
        ...


@runtime_checkable
class ValidateArgsHook(Protocol):
    def validate_args(self, args: FrozenArgs) -> Mapping[str, Any] | None:
        """Check the flags (validated by the loop already); raise ArgumentError with one clear line. Return
        the values validation normalises (a default filled in, CUDA graphs turned off), which the loop sets
        before the next plugin's check and before it freezes the configuration."""
        ...


@runtime_checkable
class PlacementHook(Protocol):
    def placement(self, args: FrozenArgs, launch: Launch) -> Placement | None:
        """Declare a layout of the launch other than one training world of every process (MegaFBD: backward
        instances that train, forward instances that serve them). The loop then gives each process its
        world's device, tensor-parallel size, sequence parallelism and world size. At most one plugin."""
        ...


@runtime_checkable
class StartProcessGroupHook(Protocol):
    def start_process_group(self, context: RunContext) -> bool:
        """Start torch.distributed for this process instead of the loop's plain start (over its world of a
        placement, through ``context.launch_store``); True when it did."""
        ...


@runtime_checkable
class RunProcessHook(Protocol):
    def run_process(self, context: RunContext, parts: "JobParts") -> bool:
        """Run this process's whole job instead of the training loop (MegaFBD's forward instances, from the
        loop's ``JobParts``); True when it did."""
        ...


@runtime_checkable
class AfterSetupHook(Protocol):
    def after_setup(self, context: RunContext, model: list[torch.nn.Module], optimizer: Any, scheduler: Any) -> None:
        """The model chunks, optimizer and learning-rate scheduler are built (a checkpoint is loaded)."""
        ...


@runtime_checkable
class ForwardBackwardFuncHook(Protocol):
    def forward_backward_func(self, context: RunContext) -> Schedule | None:
        """Supply the schedule of an iteration (at most one plugin supplies one), or None."""
        ...


@runtime_checkable
class WrapScheduleHook(Protocol):
    def wrap_schedule(self, context: RunContext, schedule: Schedule) -> Schedule:
        """Wrap whichever schedule runs (tracing, capture); return ``schedule`` itself to leave it alone."""
        ...


@runtime_checkable
class IterationBeginHook(Protocol):
    def on_iteration_begin(self, context: RunContext, iteration: int) -> None:
        """Iteration ``iteration`` (1-based) starts."""
        ...


@runtime_checkable
class IterationEndHook(Protocol):
    def on_iteration_end(self, context: RunContext, iteration: int, metrics: Mapping[str, Any]) -> None:
        """Iteration ``iteration`` ended; ``metrics``: losses (on the last pipeline stage), grad_norm, skipped."""
        ...


@runtime_checkable
class TrainEndHook(Protocol):
    def on_train_end(self, context: RunContext, iteration: int) -> None:
        """Training ended at ``iteration`` (however it ended): flush, stop servers, release memory."""
        ...


class Plugin(AddArgumentsHook, IsEnabledHook, TrainingWorldSizeHook, ValidateArgsHook, PlacementHook,
             StartProcessGroupHook, RunProcessHook, AfterSetupHook, ForwardBackwardFuncHook, WrapScheduleHook,
             IterationBeginHook, IterationEndHook, TrainEndHook, Protocol):
    """Every hook of the training loop. A plugin implements a subset: its class names those hooks as its bases
    (never ``Plugin`` itself, whose hooks a subclass would inherit as stubs)."""


Hook = TypeVar("Hook")


def _import_plugin(path: str, required: bool) -> object | None:
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


def _name(plugin: object) -> str:
    return type(plugin).__name__


class PluginRegistry:
    """Calls one hook on every enabled plugin that implements it, in registration order."""

    def __init__(self, plugins: Iterable[object]):
        self.plugins: list[object] = list(plugins)
        self.enabled: list[object] = []
        self._implementing: dict[type, list[Any]] = {}

    @classmethod
    def discover(cls, environ: Mapping[str, str] = os.environ) -> "PluginRegistry":
        found = [_import_plugin(name, required=False) for name in BUILTIN_PLUGIN_MODULES]
        extra = [p.strip() for p in environ.get(PLUGINS_ENV, "").split(",") if p.strip()]
        found += [_import_plugin(name, required=True) for name in extra]
        return cls(p for p in found if p is not None)

    def _enabled(self, hook: type[Hook]) -> list[Hook]:
        """The enabled plugins that implement ``hook`` (found once per hook)."""
        if hook not in self._implementing:
            self._implementing[hook] = [p for p in self.enabled if isinstance(p, hook)]
        return self._implementing[hook]

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        for plugin in self.plugins:
            if isinstance(plugin, AddArgumentsHook):
                plugin.add_arguments(parser)

    def select_enabled(self, args: argparse.Namespace) -> None:
        view = FrozenArgs(args)
        self.enabled = [p for p in self.plugins if not isinstance(p, IsEnabledHook) or p.is_enabled(view)]
        self._implementing = {}

    def training_world_size(self, args: argparse.Namespace, launched: int) -> int:
        """The processes that train, of the ``launched`` ones (all of them unless a plugin keeps some)."""
        size = launched
        for plugin in self._enabled(TrainingWorldSizeHook):
            size = plugin.training_world_size(FrozenArgs(args), size)
        return size

    def validate_args(self, args: argparse.Namespace) -> None:
        """Each enabled plugin checks the flags, in order; the values it returns are set on ``args`` (the
        loop's namespace, not yet frozen) before the next one checks."""
        self.select_enabled(args)
        for plugin in self._enabled(ValidateArgsHook):
            normalised = plugin.validate_args(FrozenArgs(args))
            for name, value in (normalised or {}).items():
                setattr(args, name, value)

    def placement(self, args: argparse.Namespace, launch: Launch) -> Placement:
        """The layout a plugin declares, else one training world of every launched process."""
        declared = [(p, placement) for p in self._enabled(PlacementHook)
                    if (placement := p.placement(FrozenArgs(args), launch)) is not None]
        if len(declared) > 1:
            names = ", ".join(_name(p) for p, _ in declared)
            raise ArgumentError(f"two plugins each want to lay out the launched processes ({names}); enable one")
        return declared[0][1] if declared else Placement.single_world(launch, args)

    def start_process_group(self, context: RunContext) -> bool:
        """The first plugin that starts torch.distributed for this process; whether one did."""
        return any(p.start_process_group(context) for p in self._enabled(StartProcessGroupHook))

    def run_process(self, context: RunContext, parts: "JobParts") -> bool:
        """The first plugin that runs this process's whole job; whether one did."""
        return any(p.run_process(context, parts) for p in self._enabled(RunProcessHook))

    def after_setup(self, context: RunContext, model: list[torch.nn.Module], optimizer: Any, scheduler: Any) -> None:
        for plugin in self._enabled(AfterSetupHook):
            plugin.after_setup(context, model, optimizer, scheduler)

    def forward_backward_func(self, context: RunContext, default: Schedule) -> Schedule:
        """The schedule of an iteration: the one plugin that supplies one, else ``default``."""
        supplied = [(p, f) for p in self._enabled(ForwardBackwardFuncHook)
                    if (f := p.forward_backward_func(context)) is not None]
        if len(supplied) > 1:
            names = ", ".join(_name(p) for p, _ in supplied)
            raise ArgumentError(f"two plugins each want to run the pipeline schedule ({names}); enable one")
        return supplied[0][1] if supplied else default

    def wrap_schedule(self, context: RunContext, schedule: Schedule) -> Schedule:
        """Let every enabled plugin wrap the chosen schedule, in registration order (innermost first)."""
        for plugin in self._enabled(WrapScheduleHook):
            schedule = plugin.wrap_schedule(context, schedule)
        return schedule

    def on_iteration_begin(self, context: RunContext, iteration: int) -> None:
        for plugin in self._enabled(IterationBeginHook):
            plugin.on_iteration_begin(context, iteration)

    def on_iteration_end(self, context: RunContext, iteration: int, metrics: Mapping[str, Any]) -> None:
        for plugin in self._enabled(IterationEndHook):
            plugin.on_iteration_end(context, iteration, metrics)

    def on_train_end(self, context: RunContext, iteration: int) -> None:
        for plugin in self._enabled(TrainEndHook):
            plugin.on_train_end(context, iteration)


@dataclass
class JobParts:
    """What a plugin that runs a process's whole job (``run_process``) builds its work from."""

    tokenizer: Any
    model_provider: Callable[..., torch.nn.Module]
    dataset_provider: Callable[..., Any]
    forward_step_func: Callable[..., Any]
    registry: PluginRegistry  # the other plugins' hooks (tracing) for the process's own loop
