"""The hidden directory a conversion writes in, beside its --save-dir, and the conversion's claim on that target.

The directory is ``.<name>.converting-<host>-<pid>``: its name says which process owns it, so a later
conversion into the same parent removes what a killed one left (SIGKILL, a crash, a reboot), and only
that: directories and claims named this way, of this host, whose process is gone. Another host's are
never removed (its processes cannot be seen from here); a refusal names them instead.

The claim is a symbolic link ``.<name>.converting`` -> the directory's name, made in one step (``symlink``
fails where the name exists, also on NFS, and the link carries its owner from its first instant), so a
second conversion into the same --save-dir refuses at its start, naming the first, instead of converting
fully and failing to rename.

SIGTERM and SIGINT (Ctrl-C) remove what the conversion made and end it with one line.
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Iterator

from megatron.training.errors import UserError, error_line

_STAGING_NAME = re.compile(r"\.(?P<target>.+)\.converting-(?P<host>[^/]+)-(?P<pid>\d+)")
_CLAIM_NAME = re.compile(r"\.(?P<target>.+)\.converting")
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _process_is_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host (a zombie, killed but not yet collected, is gone)."""
    if pid == os.getpid():
        return True  # called before this process makes its own: a predecessor's that had this pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: it runs
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:  # no /proc (or it just ended): take it as running, the safe side
        return False


def _dead_owner(name: str, target: str | None = None) -> int | None:
    """The pid in the staging directory name ``name`` if it is of this host and no longer runs (and, given
    ``target``, of that target), else None."""
    match = _STAGING_NAME.fullmatch(name)
    if (match is None or match["host"] != socket.gethostname() or (target is not None and match["target"] != target)
            or not _process_is_gone(int(match["pid"]))):
        return None
    return int(match["pid"])


def remove_leftovers(parent: str) -> None:
    """Removes from ``parent`` the staging directories and claims of conversions on this host that no longer
    run, and says so on stdout. Nothing else is touched."""
    for entry in os.scandir(parent):
        claim = _CLAIM_NAME.fullmatch(entry.name)
        if entry.is_symlink() and claim:
            pid = _dead_owner(os.readlink(entry.path), claim["target"])
            remove = os.unlink
        elif entry.is_dir(follow_symlinks=False):
            pid, remove = _dead_owner(entry.name), shutil.rmtree
        else:
            continue
        if pid is not None:
            with contextlib.suppress(FileNotFoundError):  # another conversion removed it first
                remove(entry.path)
                print(f"removed {entry.path}, left by a conversion that no longer runs (pid {pid})", flush=True)


class StagingDirectory:
    """The hidden directory a conversion into ``save_dir`` writes in; ``publish`` renames it to ``save_dir``.

    ``remove`` removes what this process made and nothing else: the directory (unless published), the claim,
    and the parent directories it had to create (when still empty)."""

    def __init__(self, save_dir: str):
        self.save_dir = save_dir
        self.parent, name = os.path.split(os.path.abspath(save_dir))
        self.path = os.path.join(self.parent, f".{name}.converting-{socket.gethostname()}-{os.getpid()}")
        self.claim = os.path.join(self.parent, f".{name}.converting")
        self.published = False
        self._made: list[tuple[str, Callable[[str], None]]] = []  # removed in reverse order

    def create(self) -> None:
        """Claims the target and makes the directory; a UserError names the conversion that holds the target,
        or why its parent cannot take it."""
        try:
            self._make_parents()
            remove_leftovers(self.parent)
            self._claim()
            os.mkdir(self.path)
            self._made.append((self.path, shutil.rmtree))
        except OSError as error:
            raise UserError(f"--save-dir {self.save_dir}: cannot create it in {self.parent} ({error.strerror}); "
                            f"choose another --save-dir") from None

    def _make_parents(self):
        missing = []
        directory = self.parent
        while not os.path.lexists(directory):
            missing.append(directory)
            directory = os.path.dirname(directory)
        for directory in reversed(missing):
            os.mkdir(directory)
            self._made.append((directory, os.rmdir))

    def _claim(self):
        try:
            os.symlink(os.path.basename(self.path), self.claim)
        except FileExistsError:
            try:
                held_by = os.readlink(self.claim)
            except FileNotFoundError:  # that conversion ended just now
                return self._claim()
            except OSError:  # not a link: not a conversion's
                raise UserError(f"--save-dir {self.save_dir}: {self.claim} is in the way of the claim a conversion "
                                f"makes there; move it away or choose another --save-dir") from None
            owner = _STAGING_NAME.fullmatch(held_by)
            who = f"pid {owner['pid']} on host {owner['host']}" if owner else "unknown"
            raise UserError(f"--save-dir {self.save_dir}: another conversion ({who}) is writing it, in "
                            f"{os.path.join(self.parent, held_by)}; wait for it to finish or choose another "
                            f"--save-dir (if it no longer runs, remove that directory and {self.claim})") from None
        self._made.append((self.claim, os.unlink))

    def publish(self) -> None:
        os.rename(self.path, self.save_dir)  # replaces an empty directory, fails on anything else
        self.published = True
        self._made = [(self.claim, os.unlink)]  # the output and its parents stay

    def remove(self) -> None:
        while self._made:
            path, remover = self._made[-1]
            try:
                remover(path)
            except FileNotFoundError:
                pass
            except OSError:
                if remover is not os.rmdir:
                    raise  # a parent it made stays if something else was put there since
            # Leaves the list once removed: a signal arriving meanwhile finishes the removal.
            self._made.pop()

    @contextlib.contextmanager
    def removed_on_signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT remove it and end the process with one line (exit code 128 + the signal)."""
        try:
            # A signal the process was started ignoring (SIGINT of a job started with & by a script) stays ignored.
            previous = {number: signal.signal(number, self._on_signal) for number in _HANDLED_SIGNALS
                        if signal.getsignal(number) is not signal.SIG_IGN}
        except ValueError:  # not the main thread, where Python runs handlers: signals keep their handlers
            previous = {}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def _on_signal(self, number, frame):
        self.remove()
        outcome = ("the conversion had completed" if self.published
                   else f"nothing was written to --save-dir {self.save_dir}")
        sys.stderr.write(error_line(f"interrupted by {signal.Signals(number).name}; {outcome}") + "\n")
        sys.stderr.flush()
        # Exits here: an exception raised from the handler could be caught or wrapped by the writer's code.
        os._exit(128 + number)
