"""One job at a time writes a --save directory: an exclusive lock held by rank 0 for the job's life.

Two jobs saving into one directory each rename their own ``iter_*`` directories into place and rewrite
the same tracker, so a checkpoint can mix both runs' tensors and still load and train: silently wrong.
The lock is ``flock`` on a file in the directory. The kernel releases it when the holding process exits,
however it exits (a crash or SIGKILL included), so a lock left by a dead job never blocks the next one;
the file stays (removing it could let a third job lock a file that a second one is about to lock) and
names the last holder, so that a refused job can say which job writes there.

A ``flock`` belongs to the open file, and a forked child shares its parent's open files: megatron-core's
checkpoint writers, forked by rank 0 at every save, held the lock after rank 0 was killed, and the restart was
refused in the name of a pid that no longer ran. So every child closes its copy as it is forked
(``os.register_at_fork``), and the file is not inherited across an exec (Python opens it close-on-exec): only the
process that took the lock holds it. An OFD lock (``F_OFD_SETLK``) belongs to the open file too; a POSIX record
lock is not inherited, but any ``close`` of the file by its holder drops it, and a second lock by the same process
would succeed where a second job's must be refused.
"""

import datetime
import fcntl
import os
import socket
from typing import TextIO

from megatron.training.errors import UserError

LOCK_FILENAME = ".megatron_save.lock"

_held: list[TextIO] = []  # this process's locks: open files, kept open (locked) until the process exits


def take_save_lock(save_dir: str) -> None:
    """Lock ``save_dir`` (created if missing) for this process's life, or raise a UserError naming the holder."""
    os.makedirs(save_dir, exist_ok=True)
    lock = open(os.path.join(save_dir, LOCK_FILENAME), "a+")  # noqa: SIM115  open (locked) for the job's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a job that has not yet written its name"
        lock.close()
        raise UserError(f"--save {save_dir} is being written by another job ({holder}); two jobs saving into one "
                        f"directory mix their checkpoints: wait for it to end or give another --save") from None
    lock.truncate(0)  # "a+" writes at the end whatever the position: empty it, then name this job
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    lock.write(f"host {socket.gethostname()}, pid {os.getpid()}, started {started}\n")
    lock.flush()
    _held.append(lock)


def release_save_locks() -> None:
    """Release this process's locks before it exits (tests, and a process that runs several jobs)."""
    while _held:
        _held.pop().close()


os.register_at_fork(after_in_child=release_save_locks)  # a forked child closes its copies: the parent keeps them
