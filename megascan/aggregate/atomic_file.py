"""Outputs appear whole or not at all: written under a temporary name beside the target, then renamed.

An interrupted aggregation never leaves a half-written file that a viewer or a later step would take
for a complete one, and a failed write leaves any earlier output in place.
"""

import contextlib
import os
import tempfile


@contextlib.contextmanager
def replaced_on_success(path):
    """Yields a temporary path in ``path``'s directory; renames it to ``path`` if the block succeeds."""
    directory, name = os.path.split(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(handle)
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
