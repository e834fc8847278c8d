"""Errors a user can fix, and the one place that turns them into one line and an exit code."""

import atexit
import functools
import os
import signal
import socket
import sys
import threading
import traceback

from megatron.training.error_line import error_line, program_name
from megatron.training.job_lifetime import helper_death_line, stop_watching_helpers
from megatron.training.peer_watch import ending_on_purpose, lost_peer_line

EXIT_HANDLERS_SECONDS = 5.0


class UserError(Exception):
    """A mistake in the launch (flags, files, layout): shown as one line, never as a traceback."""


class ArgumentError(UserError):
    """A flag is unknown, malformed or inconsistent with the others."""


# The claim of the rank that prints a launch's error line; held (open) until the process exits.
_printing_claim: list[socket.socket] = []


def _first_to_fail_on_this_host():
    """Whether this process prints the launch's error line: the first of the launch's local ranks to fail.

    Every rank checks the same flags, so most mistakes fail on all of them, at moments that differ
    by their start-up time. Rank 0 cannot be the one to print: when another rank exits first,
    torchrun stops the rest, and rank 0 may not even have reached the check. So the first rank to
    fail claims the line, by binding a Linux abstract socket named after the launch (the launcher's
    pid and the master port: shared by the local ranks of one launch, by nobody else); the kernel
    frees the name when the process exits, so nothing is left behind. A rank that fails after the
    claimer has exited claims again: the line can repeat, identical, but never goes missing.
    """
    if "RANK" not in os.environ or not sys.platform.startswith("linux"):
        return True  # a plain process, or no abstract sockets: print it
    name = f"\0megatron-launch-error-{os.getppid()}-{os.environ.get('MASTER_PORT', '')}"
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        claim.bind(name)
    except OSError:  # another rank of this launch holds it: it prints the line
        claim.close()
        return False
    _printing_claim.append(claim)
    return True


def _print_launch_error(line):
    try:
        # The launcher stops the other ranks with SIGTERM as soon as one exits: it must not cut this line.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals cannot be set here
        pass
    if _first_to_fail_on_this_host():
        # One write: unbuffered (PYTHONUNBUFFERED), print() writes the text and its newline apart, and the
        # launcher's own lines on the same pipe could land between them.
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _process_group_is_up():
    distributed = sys.modules.get("torch.distributed")  # never imported here: the tools start without torch
    return distributed is not None and distributed.is_available() and distributed.is_initialized()


def _report_lost_peer(error):
    """A failure that a peer's death caused (a collective's lost connection, or a step's error of its own at that
    moment: the datasets' build blamed the mock dataset) is reported as that death, in this rank's one line."""
    stop_watching_helpers()
    line = lost_peer_line(error, _process_group_is_up())
    if line is not None:
        if line:
            sys.stderr.write(error_line(line) + "\n")
        _exit(1)


def _bound_exit_handlers(code, once_exiting):
    """End the process with ``code`` if its exit handlers still run EXIT_HANDLERS_SECONDS from now: one that waits
    for a process this rank lost (megatron-core's checkpoint queue, its writer killed) would keep the rank alive. A
    daemon timer, so an ordinary exit never waits for it. ``once_exiting``: the exit is a ``SystemExit`` that its
    caller may catch (a test calling an entry point in-process), so the timer ends the process only if the
    interpreter is exiting by then (its main thread stopped, as it is while the exit handlers run)."""
    def end():
        if not once_exiting or not threading.main_thread().is_alive():
            os._exit(code)

    deadline = threading.Timer(EXIT_HANDLERS_SECONDS, end)
    deadline.daemon = True
    deadline.start()


def _exit(code, failed=False):
    """End the process with ``code``.

    With a process group up, a collective of this rank may still be in flight while the peer it waits
    for is stalled or gone (training's stop-signal vote always is in flight: see signal_handler.py). The
    interpreter's teardown would destroy that group, and gloo's destructor waits for the collective: the
    rank would never exit, and torchrun, which acts on exits, would wait with it. So here the exit
    handlers run (a trace's last windows, the loader workers' end) and the streams are flushed, and the
    process ends without the teardown; the kernel closes its sockets. ``failed``: this rank printed its failure
    itself, and tells its peers so: they add no line of their own (peer_watch.py)."""
    stop_watching_helpers()
    if failed:
        ending_on_purpose(failed=True)
    if not _process_group_is_up():
        _bound_exit_handlers(code, once_exiting=True)
        sys.exit(code)
    _bound_exit_handlers(code, once_exiting=False)
    atexit._run_exitfuncs()  # what the teardown would run first; atexit has no public call for it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_on_user_error(main):
    """Run ``main``; a ``UserError`` becomes ``<prog>: error: <message>`` on stderr and exit code 2, Ctrl-C
    one line and exit code 130 (a shell's for SIGINT). Of a launch's ranks the first to fail prints the
    line; the others exit quietly. Any of these, or a bug's traceback, ends a rank whose process group is
    up without tearing the group down (see ``_exit``)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            _report_lost_peer(error)
            _print_launch_error(error_line(str(error)))
            _exit(2, failed=True)
        except KeyboardInterrupt:  # Ctrl-C before training installs its agreed stop (start-up), or in a tool
            _print_launch_error(f"{program_name()}: interrupted by SIGINT (Ctrl-C) before it finished")
            _exit(128 + signal.SIGINT, failed=True)
        except Exception as error:
            _report_lost_peer(error)
            if (line := helper_death_line(error)) is not None:
                _print_launch_error(error_line(line))
                _exit(1, failed=True)
            if not _process_group_is_up():
                raise
            traceback.print_exc()  # a bug: its traceback, as Python would print it
            _exit(1, failed=True)

    return wrapper
