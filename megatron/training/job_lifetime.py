"""Nothing of a job outlives it: every process it starts ends with the process that started it.

torchrun starts each worker in a session of its own, so a launcher killed with its process group (a job
controller's ``kill -9 -- -PGID``, a user's Ctrl-\\) left the ranks running; and a rank killed with SIGKILL
left what it had started: megatron-core's checkpoint writers (forked per save, blocked on their queues) and its
spawned multiprocessing manager, whose resource tracker waits on a pipe that the manager keeps open.

Two rules, both through Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``: the kernel sends it when the
thread that forked the process ends, however it ends):
- a process of a torchrun job that imports the training package (a rank, or a multiprocessing child a rank
  spawned, which imports the entry script again) is killed when its parent ends; a rank replaces that signal by
  its launcher watch (peer_watch.py), which ends it with one line instead;
- a process forked by the main thread of one of ours is killed when its parent ends (data loader workers,
  checkpoint writers). A fork from another thread is left alone: that thread may end long before the process
  (the kernel would then kill the child of a live parent).
"""

import ctypes
import os
import re
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_forking: tuple[int, bool] = (0, False)  # (pid, from the main thread) of the process that forks now
# torch's DataLoader, when a worker of it was killed (its SIGCHLD handler's error, or the loader's own check).
_LOADER_WORKER_DEATH = re.compile(r"DataLoader worker \(pid.*?\) (?:is killed by signal|exited unexpectedly)[^.\n]*")


def set_parent_death_signal(signum: int) -> None:
    """Have the kernel send ``signum`` to this process when its parent (the thread that forked it) ends; 0: none."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


def _note_forking_thread() -> None:
    global _forking
    _forking = (os.getpid(), threading.current_thread() is threading.main_thread())


def _end_with_forking_parent() -> None:
    parent, from_main_thread = _forking
    if not from_main_thread:
        return
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the signal was set: it will never come
        os._exit(1)


def helper_death_line(error: BaseException) -> str | None:
    """The line for an error that says a process this rank started was killed (a data loader's worker), else None."""
    found = _LOADER_WORKER_DEATH.search(str(error))
    if found is None:
        return None
    rank = os.environ.get("RANK", "0")
    return (f"{found.group(0)}: rank {rank} stops (a process it started was killed: see the system log, dmesg, "
            f"for why)")


def end_with_parent() -> None:
    """The two rules above for this process; once, when the training package is imported (Linux only)."""
    if _libc is None:
        return
    os.register_at_fork(before=_note_forking_thread, after_in_child=_end_with_forking_parent)
    # torchrun's agent starts its workers from its main thread, which lives as long as the launcher.
    if "TORCHELASTIC_RUN_ID" in os.environ:
        set_parent_death_signal(signal.SIGKILL)
