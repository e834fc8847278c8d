"""How tools/aggregate.py scales with ranks and operations: seconds and peak memory of ``load_and_merge``,
writing the Chrome trace and detection (what ``tools/aggregate.py -b DIR -d`` does), per run size.

    python bench/aggregate_scale.py                      # simulated runs of 128, 256, 512 and 1024 ranks
    python bench/aggregate_scale.py --ranks 1024 --windows 1 2 4 --json scale.json
    python bench/aggregate_scale.py --from TRACE_DIR     # a real run's directory, its DP replicas copied

Simulated runs (megascan/simulation/simulated_traces.py) are DP x TP8 x PP8 GPT runs, 1F1B with 9 microbatches and two
layers per stage, ``--windows`` trace windows of two iterations (default 2): per rank and iteration 72
tensor-parallel all-reduces, 14-18 pipeline sends/recvs and the gradient, embedding and grad-norm
all-reduces; hosts of 8 GPUs with clocks milliseconds apart, drifting and anchored per window. At 1024
ranks and 2 windows that is 102,208 operations (matched instances). ``--from`` replicates a real
directory's data-parallel replicas until N ranks, renumbering ranks and process groups as a larger DP
would have them. Each size is measured in a fresh process, so that the peak RSS is its own. Linear
scaling shows as a constant time and memory per operation.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from megascan.aggregate.chrome_trace import write_chrome_trace
from megascan.aggregate.loading import TRACE_FILE_TEMPLATE, load_directory
from megascan.aggregate.merged_trace import load_and_merge
from megascan.detection.window_findings import judge_run
from megascan.simulation.simulated_traces import Scenario, simulate
from megascan.simulation.synthetic_traces import read_lines, write_lines
from megatron.training.garbage_collection import cycle_collection_paused
from megatron.training.host_memory import resident_bytes

SIMULATED_TP, SIMULATED_PP, MICROBATCHES = 8, 8, 9


def simulated_directory(directory, ranks, windows):
    dp = ranks // (SIMULATED_TP * SIMULATED_PP)
    if dp < 1 or ranks % (SIMULATED_TP * SIMULATED_PP):
        raise SystemExit(f"--ranks {ranks} is not a multiple of TP x PP = {SIMULATED_TP * SIMULATED_PP}")
    iterations = tuple((5 * w + 4, 5 * w + 5) for w in range(windows))
    simulate(Scenario("scale", dp, SIMULATED_TP, SIMULATED_PP, microbatches=MICROBATCHES, windows=iterations,
                      seed=ranks), directory)


class _Replicator:
    """Maps a real run's ranks and groups to a run with more data-parallel replicas.

    Rank (dp, pp, tp) of the larger run copies rank (dp mod DP, pp, tp) of the real one. A group whose
    members all sit in one replica is copied per replica (new id per replica); a group that spans
    replicas (data-parallel, world) becomes one group over all replicas of its (pp, tp) positions.
    Sequence numbers stay valid: every copy of a rank issues what its original issued."""

    def __init__(self, files, new_dp):
        first = next(iter(files.values())).metadata
        self.layout = dict(first["layout"], dp=new_dp)
        self.dp, self.new_dp = first["layout"]["dp"], new_dp
        self.coords = {rank: f.metadata["coords"] for rank, f in files.items()}
        self.at = {(c["dp"], c["pp"], c["tp"]): rank for rank, c in self.coords.items()}
        self.tp, self.pp = self.layout["tp"], self.layout["pp"]

    def new_rank(self, dp, pp, tp):
        return tp + self.tp * (dp + self.new_dp * pp)

    def rank_in_replica(self, old_rank, replica):
        c = self.coords[old_rank]
        return self.new_rank(replica, c["pp"], c["tp"])

    def group(self, group_id, group, replica):
        members = group["ranks"]
        if len({self.coords[r]["dp"] for r in members}) == 1:
            return f"{group_id}.{replica}", {"ranks": [self.rank_in_replica(r, replica) for r in members],
                                             "role": group["role"]}
        positions = sorted({(self.coords[r]["pp"], self.coords[r]["tp"]) for r in members})
        ranks = sorted(self.new_rank(d, pp, tp) for pp, tp in positions for d in range(self.new_dp))
        return f"{group_id}.all", {"ranks": ranks, "role": group["role"]}

    def line(self, line, replica):
        if line["type"] == "metadata":
            return line
        groups = {gid: self.group(gid, g, replica) for gid, g in line["groups"].items()}
        ops = [dict(op, group=groups[op["group"]][0],
                    peer=None if op["peer"] is None else self.rank_in_replica(op["peer"], replica))
               for op in line["ops"]]
        return dict(line, groups=dict(groups.values()), ops=ops)


def replicated_directory(source, directory, ranks):
    loaded = load_directory(source)
    files = loaded.files
    per_replica = loaded.layout["pp"] * loaded.layout["tp"]
    if ranks % per_replica:
        raise SystemExit(f"--ranks {ranks} is not a multiple of PP x TP = {per_replica} of {source}")
    replicator = _Replicator(files, ranks // per_replica)
    os.makedirs(directory, exist_ok=True)
    for replica in range(replicator.new_dp):
        for (dp, pp, tp), old_rank in replicator.at.items():
            if dp != replica % replicator.dp:
                continue
            metadata, *lines = read_lines(files[old_rank].path)
            coords = {"dp": replica, "pp": pp, "tp": tp}
            metadata = dict(metadata, rank=replicator.new_rank(replica, pp, tp), world_size=ranks, coords=coords,
                            layout=replicator.layout)
            write_lines(os.path.join(directory, TRACE_FILE_TEMPLATE.format(**coords)),
                        [metadata] + [replicator.line(line, replica) for line in lines])


def measure(directory):
    """One size, in this process, as tools/aggregate.py runs it (the garbage collector paused): seconds of each
    step and the peak RSS (the interpreter's own included; this process image's, not the simulating parent's)."""
    baseline = resident_bytes("VmRSS")
    if baseline is None:
        raise SystemExit("bench/aggregate_scale.py: no /proc/self/status to read memory from; run it on Linux")
    baseline_mb = baseline / 2**20
    output = os.path.join(directory, "benchmark.json")
    with cycle_collection_paused():
        started = time.perf_counter()
        merged = load_and_merge(directory)
        merged_at = time.perf_counter()
        write_chrome_trace(merged, output)
        written_at = time.perf_counter()
        report, _ = judge_run(merged)  # the whole run and each window, as -d judges them
        detected_at = time.perf_counter()
    return {"ranks": len(merged.ranks), "instances": len(merged.instances),
            "records": sum(len(i.records) for i in merged.instances),
            "events": sum(len(t.events) for t in merged.ranks.values()),
            "unaligned": len(merged.unaligned), "problems": merged.problems, "suspects": len(report.suspects),
            "max_residual_us": max((t.clock.residual_us for t in merged.ranks.values()), default=0.0),
            "load_and_merge_s": merged_at - started, "chrome_trace_s": written_at - merged_at,
            "detect_s": detected_at - written_at, "total_s": detected_at - started,
            "chrome_trace_mb": os.path.getsize(output) / 1e6,
            "peak_rss_mb": resident_bytes("VmHWM") / 2**20, "baseline_rss_mb": baseline_mb}


def _measure_in_child(directory):
    result = subprocess.run([sys.executable, __file__, "--measure", directory], capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout.splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--windows", type=int, nargs="+", default=[2], help="trace windows of simulated runs")
    parser.add_argument("--from", dest="source", metavar="TRACE_DIR", help="replicate this real run's directory")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--measure", metavar="DIR", help=argparse.SUPPRESS)  # the child process's job
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    rows = []
    for ranks in args.ranks:
        for windows in ([None] if args.source else args.windows):
            with tempfile.TemporaryDirectory(prefix=f"megascan-scale-{ranks}-") as directory:
                if args.source:
                    replicated_directory(args.source, directory, ranks)
                else:
                    simulated_directory(directory, ranks, windows)
                rows.append(_measure_in_child(directory))
    print(f"{'ranks':>6} {'instances':>9} {'records':>8} {'events':>8} {'merge s':>8} {'chrome s':>8} {'detect s':>8} "
          f"{'total s':>8} {'us/inst':>8} {'peak MB':>8} {'KB/inst':>8} {'trace MB':>8} {'resid us':>8}")
    for row in rows:
        added = row["peak_rss_mb"] - row["baseline_rss_mb"]
        print(f"{row['ranks']:>6} {row['instances']:>9} {row['records']:>8} {row['events']:>8} "
              f"{row['load_and_merge_s']:>8.2f} {row['chrome_trace_s']:>8.2f} {row['detect_s']:>8.2f} "
              f"{row['total_s']:>8.2f} {1e6 * row['total_s'] / row['instances']:>8.1f} {row['peak_rss_mb']:>8.0f} "
              f"{1024 * added / row['instances']:>8.2f} {row['chrome_trace_mb']:>8.1f} {row['max_residual_us']:>8.2f}")
        for problem in row["problems"]:
            print(f"  {row['ranks']} ranks: {problem}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
