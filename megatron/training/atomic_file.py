"""Outputs appear whole or not at all: written under a temporary name beside the target, then renamed.

The one helper for it: an interrupted write (an aggregation, a schedule log, a checkpoint tracker, a
preprocessed dataset, the sample vocabularies, a PID file) never leaves a half-written file that a viewer or a
later step would take for a complete one, a failed write leaves any earlier output in place, and the temporary
file is removed whatever happens.

The temporary file is created the way ``open(path, "w")`` creates a file, with mode 0666 less the
user's umask, and the rename keeps that mode: on a shared cluster, teammates read the merged trace
and the report as they read any other file of the user. (``tempfile.mkstemp`` would create it 0600.)
"""

import contextlib
import os
import secrets
from collections.abc import Iterator


def create_beside(directory: str, name: str) -> str:
    """A new empty file ``.<name>.<random>.tmp`` in ``directory`` (never an existing one), its path."""
    while True:
        temporary = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return temporary
        except FileExistsError:  # another writer's temporary: draw another name
            continue


@contextlib.contextmanager
def replaced_on_success(path: str) -> Iterator[str]:
    """Yields a temporary path in ``path``'s directory; renames it to ``path`` if the block succeeds."""
    directory, name = os.path.split(os.path.abspath(path))
    temporary = create_beside(directory, name)
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
