"""The form of every line that stops a command: ``<prog>: error: <message>``, as argparse writes it. Apart from
errors.py so that what errors.py imports (the peer watch) can write such a line too."""

import os
import sys


def program_name() -> str:
    return os.path.basename(sys.argv[0]) or "megatron"


def error_line(message: str) -> str:
    """``<prog>: error: <message>``, the form of every line that stops a command (argparse's)."""
    return f"{program_name()}: error: {message}"
