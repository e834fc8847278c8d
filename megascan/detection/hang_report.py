"""What the report says about a hang: the hung ranks as suspects, the blocked ranks with what they wait for."""

from __future__ import annotations

from megascan.aggregate.merged_trace import MergedTrace, OpInstance
from megascan.detection.hung_ranks import Blocked, Hung
from megascan.detection.report import Suspect

HUNG_SCORE = 100.0  # above any slow rank's score: a hang stops the job
OPERATIONS_LISTED = 3


def describe(instance: OpInstance) -> str:
    if instance.kind == "p2p":
        return f"transfer {instance.src}->{instance.dst} #{instance.seq} on group {instance.group}"
    return f"{instance.op} on {instance.role} group {instance.participants} #{instance.seq}"


def _last_recorded(merged, ranks):
    """rank -> the instance of the last operation each of ``ranks`` recorded (issued or reached)."""
    last = {}
    for instance in merged.instances:
        for rank, record in instance.records.items():
            if rank in ranks and (rank not in last or record.start > last[rank][0]):
                last[rank] = (record.start, instance)
    return {rank: instance for rank, (_, instance) in last.items()}


def hang_suspects(merged: MergedTrace, hung: list[Hung]) -> list[Suspect]:
    """A Suspect per Hung rank. A process stopped whole (SIGSTOP, a driver hang) stops its writer thread
    too, so its file may end before the operations its peers entered: the last operation it recorded
    is the last it left evidence of."""
    last = _last_recorded(merged, {entry.rank for entry in hung})
    suspects = []
    for entry in hung:
        trace = merged.ranks[entry.rank]
        recorded = describe(last[entry.rank]) if entry.rank in last else "none in the traced windows"
        reached = "; ".join(f"{describe(operation)} (iteration {operation.iteration}, entered by "
                            f"{sorted(operation.records)})" for operation in entry.operations[:OPERATIONS_LISTED])
        more = len(entry.operations) - OPERATIONS_LISTED
        suspects.append(Suspect(entry.rank, trace.coords, trace.host, trace.device_index, "hang",
                                HUNG_SCORE + len(entry.blocked), [
            f"never reached what the other members of its groups entered and wait in: {reached}"
            + (f"; {more} more" if more > 0 else ""),
            f"ranks blocked behind it: {len(entry.blocked)} ({entry.blocked})",
            f"the last operation it recorded: {recorded}"]))
    return suspects


def blocked_entries(merged: MergedTrace, blocked: list[Blocked]) -> list[dict]:
    """The report's blocked list: [{rank, coords, operation, waits_for, behind}]."""
    return [{"rank": entry.rank, "coords": merged.ranks[entry.rank].coords, "operation": describe(entry.operation),
             "waits_for": entry.waits_for, "behind": entry.behind} for entry in blocked]
