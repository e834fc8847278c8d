"""Nothing of a job outlives it: every process it starts ends with the process that started it.

torchrun starts each worker in a session of its own, so a launcher killed with its process group (a job
controller's ``kill -9 -- -PGID``, a user's Ctrl-\\) left the ranks running; and a rank killed with SIGKILL
left what it had started: megatron-core's checkpoint writers (forked per save, blocked on their queues) and its
spawned multiprocessing manager, whose resource tracker waits on a pipe that the manager keeps open.

Two rules, both through Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``: the kernel sends it when the
thread that forked the process ends, however it ends):
- a process of a torchrun job that imports the training package (a rank, or a multiprocessing child a rank
  spawned, which imports the entry script again) is killed when its parent ends; a rank replaces that signal by
  its launcher watch (peer_watch.py), which ends it with one line instead. A spawned child whose rank was killed
  before the child set its signal ends at once: megatron-core's result-queue manager, spawned at a rank's first
  save, went on importing torch for seconds (past the 10 s a killed job has) and then died of a broken pipe, with a
  traceback; the child knows its rank by the pid that the rank leaves in the environment it spawns with;
- a process forked by the main thread of one of ours is killed when its parent ends (data loader workers,
  checkpoint writers). A fork from another thread is left alone: that thread may end long before the process
  (the kernel would then kill the child of a live parent).
"""

import atexit
import ctypes
import glob
import os
import re
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_forking: tuple[int, bool] = (0, False)  # (pid, from the main thread) of the process that forks now
_STARTED_BY = "MEGATRON_JOB_PROCESS"  # the pid of the job's process whose environment this one inherited
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
    if _STARTED_BY in os.environ:  # what this child spawns is this child's
        os.environ[_STARTED_BY] = str(os.getpid())


_watching_helpers = False


def _children() -> list[int]:
    pids: list[int] = []
    for listing in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(listing) as f:
                pids += map(int, f.read().split())
        except OSError:  # the thread ended meanwhile
            continue
    return pids


def _killed_child() -> tuple[int, int] | None:
    """(pid, signal) of a child of this process that was killed or crashed, not yet collected, else None (it is
    left to its owner to collect: WNOWAIT)."""
    for pid in _children():
        try:
            ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # collected meanwhile
            continue
        # SIGKILL (kill -9, the out-of-memory killer) or a crash; not the SIGTERM a launcher's stop sends the
        # rank's whole process group, which the rank answers its own way.
        if ended is not None and (ended.si_code == os.CLD_DUMPED
                                  or (ended.si_code == os.CLD_KILLED and ended.si_status == signal.SIGKILL)):
            return pid, ended.si_status
    return None


def watch_helpers() -> None:
    """While this rank runs, a process it started that is killed or crashes (a checkpoint writer: megatron-core's
    save then waited on its queue forever; a data loader's worker; a multiprocessing helper) ends the rank in one
    line, from a SIGCHLD handler, wherever it waits. Not once the rank ends (its exit handlers stop such processes
    themselves). Linux, main thread only."""
    global _watching_helpers
    if _libc is None or _watching_helpers:
        return
    previous = signal.getsignal(signal.SIGCHLD)

    def on_child_end(signum, frame):
        if _watching_helpers and (killed := _killed_child()) is not None:
            pid, signum = killed
            rank = os.environ.get("RANK", "0")
            # The rank ends here, with its line: an exception raised from a signal handler lands wherever the main
            # thread is, and some places (a logging lock's release, an at-fork hook) print it as a traceback.
            _end_with_line(f"a process that rank {rank} started (pid {pid}: a checkpoint writer, a data loader's "
                           f"worker or a multiprocessing helper) was killed by {signal.Signals(signum).name}; "
                           f"rank {rank} stops (see the system log, dmesg, for why)")
        if callable(previous):  # torch's data loader sets its own first: chained, as it chains
            previous(signum, frame)

    signal.signal(signal.SIGCHLD, on_child_end)
    _watching_helpers = True
    atexit.register(stop_watching_helpers)  # an ordinary end: its exit handlers stop such processes themselves


_before_failed_end: list = []  # what runs before this process ends with its own failure line (the peer watch's note)


def before_failed_end(callback) -> None:
    """``callback()`` runs just before a rank ends here with its line: the peer watch (which imports this module)
    tells the rank's peers that it reported its failure itself, so they add no line of their own."""
    _before_failed_end.append(callback)


def _end_with_line(message: str) -> None:
    from megatron.training.error_line import error_line

    stop_watching_helpers()
    for callback in _before_failed_end:
        callback()
    sys.stdout.flush()
    sys.stderr.write(error_line(message) + "\n")
    sys.stderr.flush()
    os._exit(1)  # no exit handler: one may wait for the process that was killed


def stop_watching_helpers() -> None:
    """The rank ends, or reports its failure: what its exit handlers, or its launcher, stop from now on is no news
    (errors.py, the peer watch's end)."""
    global _watching_helpers
    _watching_helpers = False


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
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    set_parent_death_signal(signal.SIGKILL)
    started_by = os.environ.get(_STARTED_BY)  # None in a rank: torchrun sets none
    if started_by is not None and os.getppid() != int(started_by):
        os._exit(1)  # spawned by a process of the job that ended before the signal was set: it will never come
    os.environ[_STARTED_BY] = str(os.getpid())
