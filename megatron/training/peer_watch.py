"""Each rank watches the other ranks of its launch on this host, so that one that dies without a word (SIGKILL,
the kernel's out-of-memory killer) ends every survivor within a second, in one line each that names it.

Without it a survivor learnt of the death from its next collective with the dead rank: gloo's "Connection closed
by peer" traceback, or a misleading error of the step it was in (the datasets' build at start-up); and where it
waited on something else (MegaDPP's shared-memory channels, the agreed stop after torchrun's SIGTERM) it hung
until torchrun killed it 30 s later.

How: rank r listens on a Linux abstract socket named after the launch and r, connects to each lower local rank's
and accepts the higher ones'; each pair of local ranks shares one connection, which the kernel closes when either
process ends, however it ends (an abstract name, unlike a file, is never left behind). A rank that ends on
purpose says so first: "done" (its work finished) or "failed" (it printed its own error line: its peers' collectives
with it then fail without a line of their own, and torchrun stops them as before). End of file without a word is a
death.
Ranks on other hosts are not watched: their loss reaches a survivor as a collective's error (``lost_peer_line``).

Under torchrun the same thread watches the launcher (a pidfd of it, readable when it ends): a launcher killed,
alone or with its process group, ends every rank in one line each, where its ranks used to run on without it
(torchrun starts them in sessions of their own). Until the watch starts, the parent-death signal that
job_lifetime.py sets ends the rank without a line.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import re
import select
import socket
import struct
import sys
import threading
import time
import traceback

from megatron.training.error_line import error_line
from megatron.training.job_lifetime import before_failed_end, set_parent_death_signal, stop_watching_helpers

# How a rank ends on purpose: its work done, a failure it printed itself, or a peer's death it reported.
_DONE, _FAILED, _LOST_PEER = b"d", b"f", b"l"
_CONNECT_RETRY_S = 0.01
# A collective's error when its peer went away: gloo's, and NCCL's (its communicator or its store's socket).
_PEER_LOSS = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
                        r"NCCL communicator was aborted|DistNetworkError")
_PEER_ADDRESS = re.compile(r"Connection (?:closed|reset) by peer \[([^\]]+)\]:(\d+)")
# Wrappers between a collective and its caller: not what a rank was doing.
_WRAPPERS = {"wrapper", "__torch_function__", "handle_torch_function", "_fn"}
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_watch: PeerWatch | None = None
_phase = "start-up"  # what this rank is doing, in the words of a death's line (now_doing)


class PeerWatch:
    """The watch of this process (rank ``rank``) over the local ranks ``local_ranks`` of launch ``launch``, and over
    its launcher when ``launcher`` (a pid) is given."""

    def __init__(self, rank: int, local_ranks: range, launch: str, launcher: int | None = None):
        self.rank, self.launch = rank, launch
        self.lower = [peer for peer in local_ranks if peer < rank]  # we connect to them; the higher ones to us
        self.connections: dict[socket.socket, int | None] = {}  # connection -> peer rank (None: not yet said)
        self.words: dict[int, bytes] = {}  # peer -> what it said before it ended
        self.dead: int | None = None
        self.lock = threading.Lock()
        self.said = False
        self.ending = False  # this thread ends the process (a death's line printed): the main thread waits for it
        self.started = time.monotonic()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self._name(rank))
        self.listener.listen(len(local_ranks))
        self.launcher, self.launcher_fd = launcher, None
        if launcher is not None:
            self.launcher_fd = os.pidfd_open(launcher)
            # The watch takes over from the parent-death signal: a launcher that ended in between leaves the pidfd
            # readable, and the first select reports it.
            set_parent_death_signal(0)
        threading.Thread(target=self._run, name="peer-watch", daemon=True).start()

    def _name(self, rank):
        return f"\0megatron-peers-{self.launch}-{rank}"

    def _connect_pending(self):
        for peer in list(self.lower):
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connection.connect(self._name(peer))
                connection.sendall(struct.pack("!i", self.rank))
            except OSError:  # not listening yet (still starting): tried again at the next poll
                connection.close()
                continue
            self.lower.remove(peer)
            self.connections[connection] = peer

    def _run(self):
        while True:
            self._connect_pending()
            # Until every lower rank is connected, its listener is tried again soon: a rank killed right after
            # the start would otherwise go unseen by a peer that had not connected yet.
            # (After a minute, a lower rank that never listened ended before it could: tried now and then.)
            wait = None if not self.lower else _CONNECT_RETRY_S if time.monotonic() < self.started + 60 else 1.0
            launcher = [] if self.launcher_fd is None else [self.launcher_fd]
            readable, _, _ = select.select([self.listener, *self.connections, *launcher], [], [], wait)
            for ready in readable:
                if ready == self.launcher_fd:
                    self.launcher_fd = None
                    report_launcher_death(self.launcher)
                elif ready is self.listener:
                    connection, _ = self.listener.accept()
                    self.connections[connection] = None
                else:
                    self._read(ready)

    def _read(self, connection):
        peer = self.connections[connection]
        try:
            data = connection.recv(64) if peer is not None else connection.recv(4)
        except OSError:  # reset: the peer died with our word unread
            data = b""
        if peer is None and len(data) == 4:  # a higher rank names itself first
            self.connections[connection] = struct.unpack("!i", data)[0]
            return
        if data:
            self.words[peer] = data[-1:]
            return
        del self.connections[connection]
        connection.close()
        if peer is not None and peer not in self.words:
            self.dead = peer
            report_death(peer)

    def say(self, word: bytes) -> bool:
        """Tell every connected peer how this rank ends; only the first word counts (False for a later one)."""
        with self.lock:
            if self.said:
                return False
            self.said = True
            for connection in list(self.connections):
                try:
                    connection.sendall(word)
                except OSError:
                    pass
            return True

    def close_in_child(self) -> None:
        """In a forked child (a data loader's worker): its copies of the sockets would keep a dead rank's
        connections open, and its peers would wait for the child's end to learn of it."""
        for connection in [self.listener, *self.connections]:
            connection.close()

    def dead_peer(self, wait_s: float) -> int | None:
        """The local rank that died, if one did or does within ``wait_s`` (its connection's end of file may still
        be on its way to the watch's thread)."""
        deadline = time.monotonic() + wait_s
        while self.dead is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.dead


def start_peer_watch() -> None:
    """Start this rank's watch when torchrun launched it with peers on this host (Linux only: abstract sockets)."""
    global _watch
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None  # torchrun's worker: watch torchrun
    if _watch is not None or "RANK" not in os.environ or not sys.platform.startswith("linux") \
            or (local_size < 2 and launcher is None):
        return
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    first = rank - local_rank  # torchrun numbers the ranks of one host consecutively
    launch = f"{os.getppid()}-{os.environ.get('MASTER_PORT', '')}"
    try:
        _watch = PeerWatch(rank, range(first, first + local_size), launch, launcher)
    except OSError:  # the name is taken (not by this launch: its ranks are numbered apart): run unwatched
        return
    os.register_at_fork(after_in_child=_watch.close_in_child)
    atexit.register(ending_on_purpose, failed=False)  # an ordinary exit: its peers let it go


def now_doing(phase: str) -> None:
    """What this rank does from now on, as a peer's death line names it: 'iteration 7', 'serving requests'."""
    global _phase
    _phase = phase


def ending_on_purpose(failed: bool) -> None:
    """This rank ends by its own decision: ``failed`` when it reports its failure in its own line."""
    if _watch is not None:
        _watch.say(_FAILED if failed else _DONE)


before_failed_end(lambda: ending_on_purpose(failed=True))


def _activity(frames):
    """'in <collective> at <file:line function>' for a stack, ``frames`` innermost first as (path, line,
    function): the torch.distributed call its innermost frame in this repository made, and that frame; or ''."""
    collective = where = None
    for path, line, name in frames:
        if name in _WRAPPERS:
            continue
        if path.startswith(_REPO) and f"{os.sep}.venv{os.sep}" not in path \
                and not path.endswith(("peer_watch.py", "errors.py", "cpu_compat.py")):
            where = f"{os.path.relpath(path, _REPO)}:{line} {name}"
            break
        if f"torch{os.sep}distributed{os.sep}" in path:
            collective = name  # the outermost before our code: the call it made (broadcast_object_list)
    return " ".join(([f"in {collective}"] if collective else []) + ([f"at {where}"] if where else []))


def _main_thread_frames():
    frames, frame = [], sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames


def _main_thread_handles_an_error():
    """Whether the main thread runs errors.py's handler (or this module under it) now: its innermost frame of
    this repository is there, not in the work it called."""
    ours = [path for path, _, _ in _main_thread_frames()
            if path.startswith(_REPO) and f"{os.sep}.venv{os.sep}" not in path]
    return bool(ours) and ours[0].endswith(("errors.py", "peer_watch.py"))


def _error_activity(error):
    """Where the innermost error of ``error``'s chain was raised, as _activity says it."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return _activity([(frame.filename, frame.lineno, frame.name)
                      for frame in reversed(traceback.extract_tb(error.__traceback__))])


def _flush_and_exit(code):
    # The exit handlers (a trace's last windows, the data loader's workers) as errors._exit runs them, but from
    # this thread while the main one may be blocked: a handler that waits must not keep the rank alive.
    threading.Timer(3.0, os._exit, (code,)).start()
    stop_watching_helpers()
    # What other threads raise from now on follows from this end (a loader's worker killed by the exit handlers,
    # a transport's peer gone): the line printed says why the rank stops, their tracebacks would bury it.
    threading.excepthook = lambda args: None
    try:
        atexit._run_exitfuncs()
        for child in multiprocessing.active_children():  # a handler run off the main thread may have left some
            child.kill()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def death_line(peer: int, doing: str) -> str:
    rank = os.environ.get("RANK", "?")
    return (f"rank {peer} died (killed, out of memory or its host lost) while rank {rank} was in {_phase}"
            f"{', ' + doing if doing else ''}; rank {rank} stops too: see rank {peer}'s own log and the "
            f"system log (dmesg) for why it died")


def report_death(peer: int) -> None:
    """This rank's one line about ``peer``'s death, then its end (exit code 1); nothing if the rank already
    ends its own way (its main thread reports the death, or its own failure)."""
    if _main_thread_handles_an_error():
        return  # a collective's error of the same death: the main thread names it, with where it came from
    _end_with_line(death_line(peer, _activity(_main_thread_frames())))


def report_launcher_death(launcher: int) -> None:
    """This rank's one line about its launcher's end, then its own (exit code 1)."""
    rank = os.environ.get("RANK", "?")
    doing = _activity(_main_thread_frames())
    _end_with_line(f"the launcher (pid {launcher}) ended while rank {rank} was in {_phase}"
                   f"{', ' + doing if doing else ''}; rank {rank} stops too: the job was killed or its launcher "
                   f"died (see the system log, dmesg, for why)")


def _end_with_line(line):
    if _watch is None or not _watch.say(_LOST_PEER):
        return  # the rank already ends its own way (its line printed, or being printed)
    _watch.ending = True
    sys.stderr.write(error_line(line) + "\n")
    _flush_and_exit(1)


def _await_the_watch():
    """The watch's thread ends this process, its line printed: wait for it, whatever this thread is sent meanwhile
    (the data loader's SIGCHLD handler raises here when the exit handlers kill its workers)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            time.sleep(0.1)
        except BaseException:  # noqa: S110  nothing this thread could say now would be news
            pass
    os._exit(1)


def _chain_message(error):
    """The error's text and that of what it was raised from (a step that re-raised it its way)."""
    message = ""
    while error is not None:
        message += f" {error}"
        error = error.__cause__ or error.__context__
    return message


def is_peer_loss(error: BaseException) -> bool:
    """Whether ``error`` follows from a peer's loss (a local rank's death seen by the watch, or a collective's lost
    connection): the rank ends with that death's line, not with the error."""
    return (_watch is not None and _watch.dead is not None) or _PEER_LOSS.search(_chain_message(error)) is not None


def lost_peer_line(error: BaseException, group_up: bool) -> str | None:
    """The one line for a failure that a peer's loss caused (a local rank's death seen by the watch, or, with a
    process group up, ``group_up``, a collective's error naming a lost connection), else None; '' for a connection
    lost to a rank that failed its own way (it printed the job's line). Claims this rank's word to its peers: with
    a line, the caller prints it (if any) and ends the rank."""
    if _watch is not None and _watch.ending:
        _await_the_watch()  # the error follows from the end that the watch's thread reports
    message = _chain_message(error)
    lost = group_up and _PEER_LOSS.search(message) is not None
    # A collective's error can come before the watch's thread has read the dead rank's end of file.
    peer = _watch.dead_peer(wait_s=1.0 if lost else 0.0) if _watch is not None else None
    if peer is None and not lost:
        return None
    if peer is None and _watch is not None and _FAILED in _watch.words.values():
        return ""  # the connection lost is to a rank that failed and printed the job's line: none of our own
    if _watch is not None and not _watch.say(_LOST_PEER):
        _await_the_watch()  # the watch's thread reports it (or a failed peer's line stands) and ends the process
    doing = _error_activity(error)  # where the collective that found the peer gone was called
    if peer is not None:
        return death_line(peer, doing)
    address = _PEER_ADDRESS.search(message)
    lost_rank = f"the rank at {address.group(1)}:{address.group(2)}" if address else "a rank on another host"
    rank = os.environ.get("RANK", "?")
    return (f"lost {lost_rank} (killed, out of memory or its host lost) while rank {rank} was in {_phase}"
            f"{', ' + doing if doing else ''}; see the other ranks' logs for which one died")
