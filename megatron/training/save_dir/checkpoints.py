"""A checkpoint directory as Megatron-LM lays it out (``iter_XXXXXXX/``, the tracker file naming the latest),
and what is wrong with a ``--load`` checkpoint, in one line, before megatron-core tries to read it.

A damaged file inside a checkpoint (a shard cut short by a full disk or an interrupted copy) makes
megatron-core's loader fail on every rank with hundreds of lines that never name the file. Its
``.metadata`` says which shard files hold which bytes, so a look at their sizes finds the damage
first, and the user learns which file is bad and which other iterations could be loaded instead.
"""

import os
import pickle
import re

from torch.distributed.checkpoint import FileSystemReader

from megatron.training.errors import UserError

_ITERATION_DIR = re.compile(r"^iter_(\d{7})$")
_COMMON_FILES = ("common.pt", "metadata.json", ".metadata")


def iterations_present(root):
    """The iterations of complete-looking checkpoint directories in ``root`` (iter_XXXXXXX), sorted."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(match.group(1)) for match in map(_ITERATION_DIR.match, names)
                  if match and os.path.isdir(os.path.join(root, match.group(0))))


# What else a user can do about a bad checkpoint directory, by the flag that names it.
_OTHERWISE = {"--load": "remove --load to train from scratch", "--save": "give another --save directory",
              "--load-dir": "give another --load-dir"}


def what_to_do(root, tracker, bad_iteration=None, flag="--load"):
    """Where to go from a bad checkpoint or tracker: the (other) iterations there, or training from scratch."""
    other = "" if bad_iteration is None else "other "
    iterations = [i for i in iterations_present(root) if i != bad_iteration]
    if not iterations:
        return f"no {other}iteration is saved there: {_OTHERWISE[flag]}"
    use = "to convert it" if flag == "--load-dir" else "to resume from it"
    return (f"{other}iterations saved there: {', '.join(map(str, iterations))}; write one of them into {tracker} "
            f"{use}, or {_OTHERWISE[flag]}")


def damaged_file(directory):
    """'<file> is ...' for the first missing, unreadable or cut-short file of a checkpoint, else None."""
    for name in _COMMON_FILES:
        if not os.path.isfile(os.path.join(directory, name)):
            return f"{os.path.join(directory, name)} is missing"
    try:
        storage = FileSystemReader(directory).read_metadata().storage_data
    except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError) as error:
        return f"{os.path.join(directory, '.metadata')} cannot be read ({type(error).__name__})"
    needed = {}  # shard file -> bytes its items reach
    for item in storage.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        if os.path.getsize(path) < size:
            return f"{path} is cut short ({os.path.getsize(path)} of {size} bytes)"
    return None


TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root, flag="--load"):
    """The iteration named by the tracker file, or None when ``root`` (given as ``flag``) has no checkpoint yet."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as tracker:  # bytes: a damaged tracker need not be text
        content = tracker.read().strip()
    if not content.isdigit():  # bytes.isdigit: ASCII digits only
        shown = repr(content.decode("ascii")[:40]) if content.isascii() else repr(content[:40])
        raise UserError(f"{flag}: {path} should hold an iteration number but holds {shown}; "
                        f"{what_to_do(root, path, flag=flag)}")
    return int(content)
