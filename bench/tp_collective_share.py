"""What share of a tensor-parallel rank's recorded work its TP collectives' own transfer takes: the most that
overlapping them with their GEMMs (--tp-comm-overlap) can recover there.

    python bench/tp_collective_share.py TRACE_DIR

A MegaScan trace at --trace-granularity full records the TP collectives of --trace-tp-microbatches microbatches (the
last one's forward by default). Per rank, over those recorded stretches: its own work before each collective, and
each collective's transfer from its last member's arrival to its finish (a wait for a late peer is not transfer).
"""

import argparse

import numpy as np

from megascan.aggregate.loading import TraceDirectoryError
from megascan.aggregate.merged_trace import MergedTrace, load_and_merge
from megascan.detection.rank_timelines import build_timelines


def tp_shares(merged: MergedTrace) -> dict[int, tuple[float, float]]:
    """rank -> (its own work before its recorded TP collectives, their transfer), microseconds, for every rank that
    recorded one."""
    timelines = build_timelines(merged)
    transfer = timelines.transfer_time(timelines.arrival_awaited())
    shared = [instance.role == "tp" and len(instance.participants) > 1 for instance in timelines.instances]
    recorded = ~timelines.opaque & np.array(shared, dtype=bool)[timelines.instance]
    shares = {}
    for rank in sorted(merged.ranks):
        mine = recorded & (timelines.rank == rank)
        if mine.any():
            shares[rank] = (float(np.nansum(timelines.gap[mine])), float(np.nansum(transfer[mine])))
    return shares


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", metavar="TRACE_DIR", help="a traced run's --trace-dir")
    args = parser.parse_args(argv)
    try:
        merged = load_and_merge(args.directory)
    except TraceDirectoryError as error:
        parser.error(str(error))
    shares = tp_shares(merged)
    if not shares:
        parser.error(f"{args.directory}: no tensor-parallel collective recorded; trace a TP job at "
                     "--trace-granularity full")
    print("| rank | own work ms | TP transfer ms | transfer share |")
    print("|---:|---:|---:|---:|")
    for rank, (own_us, transfer_us) in shares.items():
        print(f"| {rank} | {own_us / 1e3:.1f} | {transfer_us / 1e3:.1f} | {transfer_us / (own_us + transfer_us):.1%} |")


if __name__ == "__main__":
    main()
