"""The figures of several runs of bench/megascan_overhead.py on one job, each alone and pooled: a 0.5 % figure
needs more rounds than one run of bench/megascan_overhead.py takes in ten minutes on one machine.

    python bench/megascan_overhead_pool.py run1.json run2.json ...   (their --bench-json files)

Per run: `off`'s iteration and the spread of its single iterations (10th..90th percentile). Per run and
pooled over all their rounds, for each traced mode: the traced iterations, the untraced ones and
the whole interval against `off`'s interval of the same round (the figures the benchmark prints), and each
traced position (the interval's 4th, 5th... iteration) against `off`'s iteration at that position. Each as the
median over rounds (in brackets its bootstrap standard error; then the mean +- its standard error). Runs of
different jobs (model, layout, CUDA graphs, interval, traced iterations) are refused.
"""

import argparse
import json
import os
import statistics

from overhead_rounds import round_ratios, single_iterations_ms, summary

from megatron.training.errors import ArgumentError, exit_on_user_error

_JOB_KEYS = ("layout", "interval", "continuous")
_LATER_KEYS = ("model", "cuda_graphs")  # added later: older runs did not write them


def _load(path):
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ArgumentError(f"{path}: cannot read it as JSON ({error})") from None
    if not isinstance(run, dict) or "off" not in run.get("runs", {}) or any(key not in run for key in _JOB_KEYS):
        raise ArgumentError(f"{path}: not a --bench-json of bench/megascan_overhead.py (no 'runs' with 'off')")
    return run


def _job(run):
    return ", ".join(f"{key} {run.get(key, 'not written')}" for key in (*_JOB_KEYS, *_LATER_KEYS))


def _format(figure):
    if figure["std_error_percent"] is None:
        return f"{figure['median_percent']:+.2f} % (one round)"
    return (f"{figure['median_percent']:+.2f} % ({figure['median_std_error_percent']:.2f}; "
            f"mean {figure['mean_percent']:+.2f} +- {figure['std_error_percent']:.2f})")


def _report(title, figures_by_mode):
    print(title)
    for mode, figures in figures_by_mode.items():
        for name, values in figures.items():
            print(f"  {mode} {name}: {_format(summary(values, bootstrap=True))}")


@exit_on_user_error
def main():
    parser = argparse.ArgumentParser(prog="megascan_overhead_pool.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="JSON", help="--bench-json files of one job")
    paths = parser.parse_args().runs
    runs = [_load(path) for path in paths]
    for path, run in zip(paths[1:], runs[1:]):
        if _job(run) != _job(runs[0]):
            raise ArgumentError(f"{path}: another job ({_job(run)}) than {paths[0]} ({_job(runs[0])}): "
                                "pool runs of one job only")
    modes = [mode for mode in ("base", "full") if all(mode in run["runs"] for run in runs)]
    pooled = {mode: {} for mode in modes}
    for path, run in zip(paths, runs):
        own = {mode: round_ratios(run["runs"], mode) for mode in ("base", "full") if mode in run["runs"]}
        deciles = statistics.quantiles(single_iterations_ms(run["runs"]["off"]), n=10)
        _report(f"{os.path.basename(path)}: {len(run['runs']['off'])} rounds, off "
                f"{run['off_ms_per_iteration']:.1f} ms an iteration (single ones p10..p90 "
                f"{deciles[0]:.0f}..{deciles[-1]:.0f})", own)
        for mode in modes:
            for name, values in own[mode].items():
                pooled[mode].setdefault(name, []).extend(values)
    if len(runs) > 1:
        _report(f"pooled: {sum(len(run['runs']['off']) for run in runs)} rounds of {len(runs)} runs ({_job(runs[0])})",
                pooled)


if __name__ == "__main__":
    main()
