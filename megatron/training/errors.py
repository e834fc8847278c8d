"""Errors a user can fix, and the one place that turns them into one line and an exit code."""

import functools
import os
import sys


class UserError(Exception):
    """A mistake in the launch (flags, files, layout): shown as one line, never as a traceback."""


class ArgumentError(UserError):
    """A flag is unknown, malformed or inconsistent with the others."""


def exit_on_user_error(main):
    """Run ``main``; a ``UserError`` becomes ``<prog>: error: <message>`` on the first rank, exit 2.
    The other ranks exit quietly so that a torchrun launch prints the line once."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            if int(os.environ.get("RANK", "0")) == 0:
                prog = os.path.basename(sys.argv[0]) or "megatron"
                print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper
