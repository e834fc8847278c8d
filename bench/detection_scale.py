"""Detection at scale: the case matrix of megascan/simulation/detection_cases.py (a healthy run, one slow GPU in every
role and two at once at 1.2-1.6x, a slow pipeline link, a rank hung at each of seven operations) on
simulated DP x TP x PP runs (megascan/simulation/simulated_traces.py: 1F1B, per-host clocks, +-3 % GPU speed spread),
each checked against what was injected: every culprit named, nothing else named.

    python bench/detection_scale.py                                  # 256, 512 and 1024 ranks
    python bench/detection_scale.py --layouts 16x8x8 --seeds 0 1 --json detection.json

A layout is DPxTPxPP; each case is simulated into a temporary directory, merged (load_and_merge) and
analysed (detect), as tools/aggregate.py -d does without writing the timeline.
"""

import argparse
import json
import sys
import tempfile
import time

from megascan.aggregate.merged_trace import load_and_merge
from megascan.detection import detect
from megascan.simulation.detection_cases import check, scenarios
from megascan.simulation.simulated_traces import simulate

DEFAULT_LAYOUTS = ("8x4x8", "16x2x8", "8x8x8", "16x8x8")


def _layout(text):
    try:
        dp, tp, pp = (int(part) for part in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout '{text}' is not DPxTPxPP, e.g. 16x8x8") from None
    return dp, tp, pp


def run_case(scenario, expected):
    with tempfile.TemporaryDirectory(prefix="megascan-detection-") as directory:
        started = time.perf_counter()
        run = simulate(scenario, directory)
        simulated = time.perf_counter()
        report = detect(load_and_merge(directory))
        analysed = time.perf_counter()
    return {"case": scenario.name, "ranks": run.layout.world_size, "instances": run.instances,
            "problems": check(report, run, expected), "simulate_s": simulated - started,
            "merge_and_detect_s": analysed - simulated}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", type=_layout, nargs="+", default=[_layout(text) for text in DEFAULT_LAYOUTS])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--json", metavar="PATH", help="also write every case's result as JSON")
    args = parser.parse_args()
    rows = []
    for dp, tp, pp in args.layouts:
        for seed in args.seeds:
            for scenario, expected in scenarios(dp, tp, pp, seed, microbatches=pp):
                row = run_case(scenario, expected)
                row.update(layout=f"DP{dp}xTP{tp}xPP{pp}", seed=seed)
                rows.append(row)
                verdict = "ok" if not row["problems"] else "MISS " + "; ".join(row["problems"])
                print(f"{row['layout']:>14} seed {seed} {row['case']:<40} {row['instances']:>7} instances "
                      f"{row['merge_and_detect_s']:6.1f} s  {verdict}", flush=True)
    misses = [row for row in rows if row["problems"]]
    print(f"{len(rows)} cases, {len(misses)} missed")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
