"""This process's resident host memory, read from /proc/self/status (Linux), and the C allocator's
free memory handed back.

Not getrusage's ru_maxrss: an exec'd process inherits that peak from the process it was forked
from (a test runner or shell holding a model would show as our peak)."""

import ctypes


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


def peak_line(before):
    """One line: the peak, and how far above ``before`` (bytes held before the work, e.g. the imports)."""
    peak = resident_bytes("VmHWM")
    if peak is None or before is None:
        return None
    return (f"peak host memory: {peak / 1e9:.3f} GB, {(peak - before) / 1e9:.3f} GB above the "
            f"{before / 1e9:.3f} GB held before converting")


def return_freed_memory():
    """Hands the C allocator's free heap memory back to the system (glibc; elsewhere nothing).

    glibc serves tensors below its mmap threshold (at most 32 MB) from its heap and keeps what is
    freed there: a layer's worth of such holes would otherwise stay resident for the whole run."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # no C library to load, or not glibc
        pass
