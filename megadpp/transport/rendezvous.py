"""Agreeing on segment names through a torch.distributed Store, and checking /dev/shm has room."""

from __future__ import annotations

import contextlib
import os
import re
import secrets

import torch.distributed as dist

from megadpp.transport.native import TransportSetupError

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "megadpp-"
_SEGMENT = re.compile(rf"{SEGMENT_PREFIX}(\d+)-\d+to\d+-[0-9a-f]{{8}}")  # segment_name's, without its slash


def default_store() -> dist.Store:
    """The default process group's Store; TransportSetupError before torch.distributed is initialized."""
    if not dist.is_initialized():
        raise TransportSetupError("megadpp transport: torch.distributed is not initialized; pass a store")
    return dist.distributed_c10d._get_default_store()


def segment_name(rank: int, peer: int) -> str:
    """Per run and per process: the creator's pid and a random token, so no two runs (or two
    transports of one run) can meet on a name, and a test can tell a run's segments apart."""
    return f"/{SEGMENT_PREFIX}{os.getpid()}-{rank}to{peer}-{secrets.token_hex(4)}"


def remove_abandoned_segments() -> None:
    """Unlink the segments of this user whose creator no longer runs.

    A segment is unlinked once its receiver has it open, so nothing stays after a run; but a job killed while its
    channels were being set up (created, not yet opened) leaves its segments in /dev/shm, where nothing else would
    ever remove them. The next transport started here removes them: only those named as segment_name names them,
    owned by this user, whose creator's pid is gone."""
    for entry in os.scandir(SHM_DIR):
        found = _SEGMENT.fullmatch(entry.name)
        if found is None:
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            os.kill(int(found.group(1)), 0)
        except ProcessLookupError:  # its creator is gone: the segment is abandoned
            with contextlib.suppress(FileNotFoundError):  # another rank of the node removed it first
                os.unlink(entry.path)
        except OSError:  # gone meanwhile, or its creator runs as another user
            continue


def channel_key(name: str, src: int, dst: int) -> str:
    """The Store key under which ``src`` publishes its segment name for the channel to ``dst``."""
    return f"{name}/channel/{src}->{dst}"


def check_shm_room(needed: int, channels: int, limit: int | None = None) -> None:
    """Fail in one line, naming the size needed, before creating anything."""
    stat = os.statvfs(SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    room = free if limit is None else min(free, limit)
    if needed > room:
        limit_note = "" if limit is None else f" (capped at {limit} bytes)"
        raise TransportSetupError(
            f"megadpp transport: {SHM_DIR} has {room} bytes free{limit_note} but the {channels} channel(s) of this "
            f"rank need {needed} bytes ({-(-needed // 2**20)} MiB); enlarge it (e.g. docker run --shm-size="
            f"{-(-needed * 8 // 2**30)}g for 8 ranks) or lower the transport's slots / slot bytes")
