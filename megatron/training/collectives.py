"""Collectives on Python objects that the generation server and the plugins share."""

from __future__ import annotations

from typing import Any

import torch


def gather_objects(obj: Any, group: torch.distributed.ProcessGroup, dst_index: int) -> list | None:
    """Every rank's ``obj`` on the ``dst_index``-th rank of ``group`` (a list in group order), else None."""
    ranks = torch.distributed.get_process_group_ranks(group)
    if len(ranks) == 1:
        return [obj]
    received = [None] * len(ranks) if torch.distributed.get_rank() == ranks[dst_index] else None
    torch.distributed.gather_object(obj, received, dst=ranks[dst_index], group=group)
    return received
