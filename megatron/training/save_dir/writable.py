"""Whether the places a run will write to can be written, checked at start-up by writing there.

An output that cannot be written used to fail only when the run first wrote to it: a checkpoint after
--save-interval iterations of work, TensorBoard's first scalars, MegaDPP's schedule log at the very end,
each with a stack trace. ``os.access`` cannot tell in advance: it says yes to root (the usual user in a
container) in a read-only directory. So the check creates (and removes) a file where the output will go.
A directory that does not exist yet is not created here: the nearest existing parent is tried instead,
so a launch refused by a later check leaves nothing behind.
"""

import os

from megatron.training.atomic_file import create_beside
from megatron.training.errors import UserError


def nearest_existing(path: str) -> str:
    """``path`` itself when it exists, else its nearest existing parent."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        current = os.path.dirname(current)
    return current


def _try_creating_a_file_in(directory):
    """None when a new file can be created (and was removed again) in ``directory``, else the OS's reason."""
    try:
        probe = create_beside(directory, "write-test")
    except OSError as error:
        return error.strerror or type(error).__name__
    os.remove(probe)
    return None


def _why_not_writable(directory):
    """What stops files from being written into ``directory`` (or its nearest existing parent), or None."""
    existing = nearest_existing(directory)
    if not os.path.isdir(existing):
        return "is a file" if existing == os.path.abspath(directory) else f"is under {existing}, which is a file"
    reason = _try_creating_a_file_in(existing)
    return None if reason is None else f"cannot be written: creating a file in {existing} fails ({reason})"


def check_directory_writable(directory: str, flag: str) -> None:
    """A UserError naming ``flag`` when ``directory`` could not be created or written into."""
    reason = _why_not_writable(directory)
    if reason is not None:
        raise UserError(f"{flag} {directory} {reason}; give a directory you can write to")


def check_new_file_writable(path: str, flag: str) -> None:
    """A UserError naming ``flag`` when the file ``path`` exists (it would be replaced) or cannot be written."""
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a directory; give the path of a new file")
    if os.path.exists(path):
        raise UserError(f"{flag} {path} already exists and would be overwritten; remove it or give a new file name")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(directory):  # a file's directory is not made for it: the write at the end would fail
        raise UserError(f"{flag} {path}: its directory {directory} does not exist; create it or give a path in an "
                        f"existing directory")
    reason = _why_not_writable(directory)
    if reason is not None:
        raise UserError(f"{flag} {path}: its directory {directory} {reason}; give a path you can write to")
