"""Stage (d): operations some members entered and others never reached.

Sequence numbers name each collective instance and each send/recv pair, so a member without a
record never issued it. Each rank stuck in an incomplete operation waits for the members
missing from it; following those "waits for" edges leads to the ranks that wait for nobody:
the hung ranks. Ranks that only wait are their victims.
"""


def _describe(instance):
    if instance.kind == "p2p":
        return f"{instance.op} p2p {instance.src}->{instance.dst} #{instance.seq}"
    return f"{instance.op} on {instance.role} group {instance.participants} #{instance.seq}"


def _last_recorded(merged, ranks):
    """rank -> (start, instance) of the last operation each of ``ranks`` recorded."""
    last = {}
    for instance in merged.instances:
        for rank, record in instance.records.items():
            if rank in ranks and (rank not in last or record["start"] > last[rank][0]):
                last[rank] = (record["start"], instance)
    return last


def find_hangs(merged):
    """[{rank, operation, iteration, entered_by, waiting_ranks, last_recorded}] per hung rank.

    A process stopped whole (SIGSTOP, a driver hang) stops its writer thread too, so its file may end
    before the operations its peers entered: ``last_recorded`` is the last one it left evidence of.
    """
    blocking = {}  # rank -> (start, instance): the first incomplete operation it entered
    for instance in merged.instances:
        missing = [rank for rank in instance.missing if rank in merged.ranks]
        if not missing:
            continue
        for rank, record in instance.records.items():
            if rank in merged.ranks and (rank not in blocking or record["start"] < blocking[rank][0]):
                blocking[rank] = (record["start"], instance)
    waits_for = {rank: [r for r in instance.missing if r in merged.ranks]
                 for rank, (_, instance) in blocking.items()}
    hung = {}
    for waiter, targets in waits_for.items():
        for target in targets:
            root, seen = target, set()
            while root in waits_for and root not in seen:  # follow to a rank that waits for nobody
                seen.add(root)
                root = waits_for[root][0]
            entry = hung.setdefault(root, {"rank": root, "waiting_ranks": set(), "operation": None})
            entry["waiting_ranks"].add(waiter)
    last_seen = _last_recorded(merged, hung)
    for root, entry in hung.items():
        # The operation it never reached: the earliest incomplete one it is missing from.
        firsts = [(start, instance) for waiter, (start, instance) in blocking.items() if root in instance.missing]
        start, instance = min(firsts, key=lambda item: item[0])
        entry.update(operation=_describe(instance), iteration=instance.iteration,
                     entered_by=sorted(instance.records), waiting_ranks=sorted(entry["waiting_ranks"]),
                     last_recorded=_describe(last_seen[root][1]) if root in last_seen else None)
    return sorted(hung.values(), key=lambda entry: -len(entry["waiting_ranks"]))
