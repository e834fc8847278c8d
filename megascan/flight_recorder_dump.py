"""Write PyTorch's flight recorder beside the trace when a traced window stalls: a second witness of a hang.

PyTorch keeps, per process, a ring buffer of the last collectives and point-to-point operations each
process group entered, with their sequence numbers and states, when ``TORCH_NCCL_TRACE_BUFFER_SIZE``
(NCCL) or ``TORCH_FR_BUFFER_SIZE`` (any backend) is above zero. NCCL dumps it itself on a collective's
timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, files ``$TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>``), but only
after the process group's timeout (10 minutes by default), and gloo never does. The trace writer sees a
stall after seconds, so it writes the buffer then, as ``flight-recorder-<rank>.pkl`` in the trace
directory, where ``tools/aggregate.py`` reads it. A stopped process writes nothing: its missing dump is
itself evidence. Environment and reading: docs/megascan_aggregate.md.
"""

import os

import torch.distributed as dist

from megatron.training.atomic_file import replaced_on_success

BUFFER_SIZE_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_NAME = "flight-recorder-{rank}.pkl"


def recorder_enabled(environ=os.environ) -> bool:
    """Whether PyTorch records (its buffer size comes from the first of these variables that is set)."""
    for name in BUFFER_SIZE_VARIABLES:
        value = environ.get(name)
        if value is not None:
            return value.strip().isdigit() and int(value) > 0
    return False


def _dump_bytes():
    """The pickled buffer of the backend this process's default group runs on."""
    from torch._C import _distributed_c10d as c10d

    if dist.get_backend() == "nccl" and hasattr(c10d, "_dump_nccl_trace"):
        return c10d._dump_nccl_trace()
    return c10d._dump_fr_trace()


def dump_flight_recorder(directory: str) -> str | None:
    """Write this process's flight-recorder buffer to ``directory`` under its rank in the default group (the
    numbering of the dump's own group members); its path, or None when not recording. Each call replaces
    the previous dump: the latest holds the most."""
    if not recorder_enabled() or not dist.is_initialized():
        return None
    path = os.path.join(directory, DUMP_NAME.format(rank=dist.get_rank()))
    with replaced_on_success(path) as temporary, open(temporary, "wb") as out:
        out.write(_dump_bytes())
    return path
