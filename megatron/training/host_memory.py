"""This process's resident host memory, read from /proc/self/status (Linux).

Not getrusage's ru_maxrss: an exec'd process inherits that peak from the process it was forked
from (a test runner, shell or benchmark driver holding a model would show as our peak)."""


def resident_bytes(field):
    """VmRSS (now) or VmHWM (the peak of this process image), or None where /proc does not tell."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # given in kB
    except OSError:
        pass
    return None
