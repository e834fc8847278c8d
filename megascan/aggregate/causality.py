"""Clocks that respect causality: no receive completes before its send was issued, and no collective
completes on a member before its last member issued it.

The fit (alignment.py) puts each rank where its collectives finish together with the others'. Where
the finishes scatter (gloo on an oversubscribed CPU host returns members from one collective
milliseconds apart) or the wall clocks are used as they are, a rank can stay off by more than a
transfer takes, and its transfers then run backwards on the timeline (Perfetto silently drops such
flows). The trace itself bounds every pair of clocks, with each rank's rate kept and a shift d added
to its global times:

    recv end on dst + d[dst]  >=  send start on src + d[src] + GAP          (each transfer)
    end on r + d[r]           >=  T[k]  >=  start on l + d[l] + GAP         (each collective k, members l, r)

(T[k], one per collective, keeps these linear in the members rather than quadratic.) These are
difference constraints, x[v] <= x[u] + w, a shortest-path problem: the reference rank fixed at 0,
the shortest paths from it give each shift's upper bound U and those to it the lower bound L, and
both U and L are solutions. Two more: the latest solution not later than max(0, L) (every rank moved
earlier unless it must move later: a rank that must move earlier moves least), and the earliest one
not earlier than min(0, U) (the converse); as any point between two solutions is one, so is their
midpoint. The correction is whichever of these three moves the ranks least in total: a rank that no
violated bound concerns keeps shift 0, and the reference keeps its clock. A cycle of bounds that no
shifts satisfy (the traces contradict themselves) leaves the clocks as fitted; what still runs
backwards is counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from megascan.clock_alignment import RankClock

if TYPE_CHECKING:  # merged_trace imports this module
    from megascan.aggregate.merged_trace import OpInstance

# A message takes at least this long; also above float64's resolution of microseconds since 1970
# (0.25 us), so that a corrected transfer cannot run backwards once written.
GAP_US = 1.0


@dataclass
class CausalityCheck:
    checked: int = 0  # transfers and collective finishes (one per member) whose order was checked
    backwards: int = 0  # of those, how many ran backwards on the fitted clocks
    shifts_us: dict = field(default_factory=dict)  # rank -> microseconds added to its global times (moved only)
    remaining: int = 0  # still backwards after the correction (contradictory traces)


def _orderings(instances, ranks):
    """[(earlier rank, its issue, later rank, its completion)] in global microseconds (the records' start
    and end), per transfer and per collective member of ``ranks``; collectives as (members' issues,
    members' completions) for the T nodes. Ops only issued (a stalled window's) have neither."""
    transfers, collectives = [], []
    for instance in instances:
        timed = {rank: (record.start, record.end) for rank, record in instance.records.items()
                 if rank in ranks and not record.issued_only}
        if instance.kind == "p2p":
            send, recv = timed.get(instance.src, (None, None)), timed.get(instance.dst, (None, None))
            if send[0] is not None and recv[1] is not None:
                transfers.append((instance.src, send[0], instance.dst, recv[1]))
        else:
            issues = [(rank, start) for rank, (start, _) in timed.items() if start is not None]
            completions = [(rank, end) for rank, (_, end) in timed.items() if end is not None]
            if len(issues) >= 2 and completions:
                collectives.append((issues, completions))
    return transfers, collectives


def _count_backwards(transfers, collectives):
    backwards = sum(end < start for _, start, _, end in transfers)
    for issues, completions in collectives:
        last = max(start for _, start in issues)
        backwards += sum(end < last for _, end in completions)
    return len(transfers) + sum(len(completions) for _, completions in collectives), int(backwards)


def _constraints(ranks, transfers, collectives):
    """Edges (u, v, w): x[v] <= x[u] + w over nodes ranks..., then one T node per collective."""
    node = {rank: index for index, rank in enumerate(ranks)}
    tightest = {}  # (dst, src) -> the least slack of its transfers: only that one can bind
    for src, start, dst, end in transfers:
        key = node[dst], node[src]
        tightest[key] = min(tightest.get(key, np.inf), end - start - GAP_US)
    u, v = (list(ends) for ends in zip(*tightest)) if tightest else ([], [])
    w = list(tightest.values())
    for k, (issues, completions) in enumerate(collectives):
        t = len(ranks) + k
        # T is measured from the last issue plus GAP: 0 when nothing needs to move.
        last = max(start for _, start in issues)
        for rank, start in issues:
            u.append(t), v.append(node[rank]), w.append(last - start)
        for rank, end in completions:
            u.append(node[rank]), v.append(t), w.append(end - last - GAP_US)
    return np.array(u, dtype=np.int64), np.array(v, dtype=np.int64), np.array(w, dtype=np.float64)


def _shortest(edges, start, hops):
    """Bellman-Ford from ``start`` (per-node initial bounds >= 0, inf where free); None on a negative cycle.

    ``hops``: the most edges of a path without a cycle, after which the bounds stop changing unless a
    cycle lowers them. No such path weighs less than all negative edges together: a bound below that
    proves a cycle early."""
    u, v, w = edges
    floor = w[w < 0].sum()
    x = start.copy()
    for _ in range(hops + 1):
        relaxed = x.copy()
        np.minimum.at(relaxed, v, x[u] + w)
        if np.array_equal(relaxed, x):
            return x
        if relaxed.min() < floor - GAP_US:
            return None
        x = relaxed
    return None


def _reverse(edges):
    """The same constraints over y = -x: x[v] <= x[u] + w  <=>  y[u] <= y[v] + w."""
    u, v, w = edges
    return v, u, w


def _shifts(edges, ranks, nodes, reference, hops):
    """Shifts of every node satisfying ``edges``, the reference at 0, the first ``ranks`` nodes moved least
    (see the module docstring); None if none do."""
    pinned = np.full(nodes, np.inf)
    pinned[reference] = 0.0
    upper = _shortest(edges, pinned, hops)  # U: the latest each node can be, the reference at 0
    to_reference = _shortest(_reverse(edges), pinned, hops)  # -L
    if upper is None or to_reference is None:
        return None
    latest = _shortest(edges, np.maximum(0.0, -to_reference), hops)  # the latest solution <= max(0, L)
    earliest_negated = _shortest(_reverse(edges), -np.minimum(0.0, upper), hops)  # the earliest >= min(0, U)
    if latest is None or earliest_negated is None:
        return None
    candidates = (latest, -earliest_negated, (latest - earliest_negated) / 2)
    return min(candidates, key=lambda shifts: np.abs(shifts[:ranks]).sum())


def causal_clocks(instances: list[OpInstance], clocks: dict[int, RankClock], reference: int,
                  retime: Callable[[int, RankClock], None]) -> tuple[dict[int, RankClock], CausalityCheck]:
    """(clocks shifted so that no transfer or collective finish runs backwards where the traces allow,
    CausalityCheck). ``clocks``: rank -> RankClock from the fit, whose global times the records already carry;
    ranks without one are left out. ``retime(rank, clock)`` puts a shifted rank's times on its new clock."""
    transfers, collectives = _orderings(instances, clocks)
    checked, backwards = _count_backwards(transfers, collectives)
    check = CausalityCheck(checked, backwards, remaining=backwards)
    if not backwards or reference not in clocks:
        return clocks, check
    ranks = sorted(clocks)
    edges = _constraints(ranks, transfers, collectives)
    # A path without a cycle alternates ranks and T nodes: at most two edges per rank.
    shifts = _shifts(edges, len(ranks), len(ranks) + len(collectives), ranks.index(reference),
                     hops=2 * len(ranks) + 1)
    if shifts is None:
        return clocks, check
    corrected = dict(clocks)
    for rank, shift in zip(ranks, shifts[:len(ranks)].tolist()):
        if shift:
            clock = clocks[rank]  # global + shift = (local - offset' - window offset) / rate
            corrected[rank] = dataclasses.replace(clock, offset_us=clock.offset_us - shift * clock.rate)
            check.shifts_us[rank] = shift
            retime(rank, corrected[rank])
    check.remaining = _count_backwards(*_orderings(instances, corrected))[1]
    return corrected, check
