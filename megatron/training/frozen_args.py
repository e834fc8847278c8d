"""The run's configuration once validated: argparse's namespace, read-only.

The flags are parsed once and validated in one place (``validate_args.py`` and the plugins'
``validate_args``, which may normalise values by returning them); after that nobody edits them. A plugin
reads the configuration with the same names as argparse's namespace (``args.train_iters``), and a write
raises ``FrozenArgsError`` naming the flag and what to do instead, so that no plugin uses the
configuration as a message bus (stopping the loop, changing the layout, telling another plugin).
"""

import argparse
from collections.abc import Mapping
from typing import Any, NoReturn


class FrozenArgsError(AttributeError):
    """Something wrote to the run's read-only configuration (a programming error, not a user's)."""


_WHAT_TO_DO = ("the configuration is read-only once validated: a plugin normalises its flags by returning "
               "the values from validate_args, declares a layout of its own with placement(), and ends training "
               "with context.request_stop(reason)")


class FrozenArgs(argparse.Namespace):
    """argparse's namespace, read-only: reads as fast as the namespace's (the values sit in the instance
    dictionary), every write or delete raises ``FrozenArgsError``."""

    def __init__(self, values: Mapping[str, Any] | argparse.Namespace):
        # Filled behind __setattr__'s back: that is what makes every later write fail.
        self.__dict__.update(vars(values) if isinstance(values, argparse.Namespace) else values)

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise FrozenArgsError(f"cannot set args.{name}: {_WHAT_TO_DO}")

    def __delattr__(self, name: str) -> NoReturn:
        raise FrozenArgsError(f"cannot delete args.{name}: {_WHAT_TO_DO}")

    def replaced(self, **values: Any) -> "FrozenArgs":
        """A new read-only configuration with ``values`` changed (this one stays as it is)."""
        return FrozenArgs({**vars(self), **values})
