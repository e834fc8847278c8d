"""A free port for a process group that starts on this host alone (a single-process group, a local launch)."""

import socket


def free_port() -> int:
    """A TCP port no process on this host listens on now, for MASTER_PORT. Another process may take it before
    the group binds it: use it at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
