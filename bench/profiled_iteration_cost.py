"""What a --profile --use-pytorch-profiler window costs, read off a job's own log (--log-interval 1).

The profiled iterations [start, end) and the one after them (which pays the profiler's stop and
the trace's export) are set against the median of the other iterations from the 5th on:

    python bench/profiled_iteration_cost.py train.log --profile-step-start 10 --profile-step-end 12
"""

import argparse
import re
import statistics

ITERATION_TIME = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?per iteration \(ms\): ([0-9.]+)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log")
    parser.add_argument("--profile-step-start", type=int, required=True)
    parser.add_argument("--profile-step-end", type=int, required=True)
    args = parser.parse_args()
    with open(args.log) as f:
        times = {int(i): float(ms) for i, ms in ITERATION_TIME.findall(f.read())}
    recorded = range(args.profile_step_start, args.profile_step_end)
    stopping = args.profile_step_end  # its log line carries the profiler's stop and the trace's export
    others = [ms for i, ms in times.items()
              if i >= 5 and i not in recorded and i not in (stopping, args.profile_step_start - 1)]
    baseline = statistics.median(others)
    recording = statistics.mean(times[i] for i in recorded) - baseline
    stop = times[stopping] - baseline
    with_stop = recording + stop / len(recorded)
    print(f"{args.log}: unprofiled {baseline:.1f} ms/iteration (median of {len(others)}); a profiled iteration "
          f"+{recording:.1f} ms ({recording / baseline * 100:+.1f} %) while recording, stop and export "
          f"+{stop:.1f} ms; with the stop spread over the window {with_stop / baseline * 100:+.1f} % per "
          f"profiled iteration")


if __name__ == "__main__":
    main()
