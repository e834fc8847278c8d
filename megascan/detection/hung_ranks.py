"""Which ranks hung and which are only blocked behind them, from the operations of a stalled window.

A window that never finished leaves only what each rank's host issued (``issued`` lines: no finish
times). A host may issue operations ahead of its stream, so having issued an operation does not mean
having reached it. What the stream could reach follows from the dependency graph:

- an operation cannot complete if a member never issued it (it is missing), or if a member's stream
  is stuck before it;
- a rank's stream is stuck at its first operation that cannot complete, and so is everything after it.

Propagated to a fixed point (each record is visited once), that gives each rank the operation its
stream is stuck in, and whom it waits for there: the members missing from it or stuck before it.
Following those waits-for edges through collectives and pipeline exchanges ends at ranks that wait
for nobody yet never reached an operation their group's other members reached: those are hung. The
others are blocked, and each is listed with what it waits for. An instance whose present members all
finished is not evidence of a hang (a member's record was lost, e.g. a cut file), so only stalled
instances count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megascan.aggregate.merged_trace import MergedTrace, OpInstance


@dataclass
class Hung:
    rank: int
    operations: list  # the stalled OpInstances it never reached that others wait for it in, earliest first
    blocked: list = field(default_factory=list)  # ranks whose waits-for chain ends at it


@dataclass
class Blocked:
    rank: int
    operation: OpInstance  # its stream is stuck in this one
    waits_for: list  # ranks missing from it or stuck before it
    behind: list  # the hung ranks its chain ends at (empty: a cycle)


def _stalled_sequences(merged):
    """rank -> its issued-only records' instances in issue order; and the stalled instances."""
    sequences, stalled = {rank: [] for rank in merged.ranks}, set()
    for instance in merged.instances:
        for rank, record in instance.records.items():
            if record.issued_only and rank in sequences:
                sequences[rank].append((record.start, instance))
                stalled.add(instance.id)
    return {rank: [instance for _, instance in sorted(items, key=lambda item: item[0])]
            for rank, items in sequences.items()}, stalled


def _stuck_positions(merged, sequences):
    """rank -> index in its sequence of the first operation its stream cannot pass (len: none)."""
    position = {rank: {instance.id: index for index, instance in enumerate(items)} for rank, items in sequences.items()}
    stuck = {rank: len(items) for rank, items in sequences.items()}
    frontier = []
    for rank, items in sequences.items():
        for index, instance in enumerate(items):
            if any(member in merged.ranks for member in instance.missing):
                frontier.append((rank, index))
                break
    while frontier:
        rank, index = frontier.pop()
        if index >= stuck[rank]:
            continue
        # Nothing at or after ``index`` completes for this rank: every such instance holds its other members
        # (those from the old stuck position on were handled when it was set).
        passed, stuck[rank] = stuck[rank], index
        for instance in sequences[rank][index:passed]:
            for member in instance.records:
                at = position.get(member, {}).get(instance.id)
                if at is not None and at < stuck[member]:
                    frontier.append((member, at))
    return stuck, position


def _waits_for(merged, sequences, stuck, position):
    waits = {}
    for rank, items in sequences.items():
        if stuck[rank] == len(items):
            continue
        instance = items[stuck[rank]]
        waits[rank] = (instance, sorted(
            member for member in instance.participants
            if member != rank and member in merged.ranks
            and (member not in instance.records or position[member].get(instance.id, -1) > stuck[member])))
    return waits


def _chain_ends(rank, waits):
    """The ranks that ``rank``'s waits-for chains end at (they wait for nobody); empty for a cycle."""
    ends, seen, frontier = set(), {rank}, list(waits[rank][1])
    while frontier:
        other = frontier.pop()
        if other in seen:
            continue
        seen.add(other)
        if other in waits and waits[other][1]:
            frontier.extend(waits[other][1])
        else:
            ends.add(other)
    return sorted(ends)


def classify_hang(merged: MergedTrace) -> tuple[list[Hung], list[Blocked]]:
    """([Hung], [Blocked]) from the stalled window's operations; both empty when nothing stalled."""
    sequences, stalled = _stalled_sequences(merged)
    if not stalled:
        return [], []
    stuck, position = _stuck_positions(merged, sequences)
    waits = _waits_for(merged, sequences, stuck, position)
    blocked = [Blocked(rank, instance, targets, _chain_ends(rank, waits))
               for rank, (instance, targets) in sorted(waits.items()) if targets]
    behind: dict[int, list[int]] = {}  # hung rank -> the ranks blocked behind it
    for entry in blocked:
        for end in entry.behind:
            behind.setdefault(end, []).append(entry.rank)
    hung = []
    for rank in sorted(behind):
        # Which operation it stopped before is not recorded (its host stopped issuing); the ones the others
        # wait for it in are: each is an operation its group's other members reached and it did not.
        waited_in = {entry.operation.id: entry.operation for entry in blocked
                     if rank in entry.waits_for and rank in entry.operation.missing}
        if waited_in:
            hung.append(Hung(rank, sorted(waited_in.values(), key=_entered_at), behind[rank]))
    return hung, blocked


def _entered_at(instance):
    return min(record.start for record in instance.records.values())
