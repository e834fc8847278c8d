"""Peak host memory of a conversion, and the C allocator's free memory handed back.

The readings come from megatron.training.host_memory (/proc, not getrusage: see there)."""

import ctypes

from megatron.training.host_memory import resident_bytes


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
