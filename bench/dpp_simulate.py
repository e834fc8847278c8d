"""Compare pipeline schedules on a cost model: makespan of one iteration and peak in-flight activations of
megatron-core's 1F1B and interleaved 1F1B against DPP's depth-first and breadth-first policies (the
policy code the runtime runs, megadpp/policy.py), healthy and with jitter or one straggler stage or link.

    python bench/dpp_simulate.py                      # the table in docs/benchmarks.md
    python bench/dpp_simulate.py --stages 4 8 --microbatches 16 --straggler-ms 3 --probability 0.3

Costs default to units of one stage's forward of one microbatch (forward 1, backward 2, transfer 0.05);
each scenario's delays are drawn from seeds 0..--seeds-1, the same for every schedule.
"""

import argparse
import statistics

from megadpp.iteration_model import CostModel
from megadpp.policy import POLICIES
from megadpp.runtime import default_caps
from megadpp.simulator import simulate
from megadpp.static_orders import static_order


def scenarios(options, stages):
    base = dict(forward_ms=options.forward_ms, backward_ratio=2.0, transfer_ms=options.transfer_ms)
    middle = stages // 2
    return {
        "healthy": dict(base),
        f"jitter 0..{options.jitter_ms:g} on every compute": dict(base, jitter_ms=options.jitter_ms),
        f"stage {middle} +{options.straggler_ms:g} on {options.probability:.0%} of microbatches":
            dict(base, straggler_stage=middle, straggler_ms=options.straggler_ms,
                 straggler_probability=options.probability),
        f"link {middle}->{middle + 1} +{options.straggler_ms:g} on {options.probability:.0%} of transfers":
            dict(base, straggler_link=middle, straggler_ms=options.straggler_ms,
                 straggler_probability=options.probability),
    }


def schedules(stages, microbatches, chunks):
    """name -> (model chunks, static orders or None, policy or None)"""
    found = {"1F1B": (1, {r: static_order(r, stages, 1, microbatches) for r in range(stages)}, None)}
    interleaved = microbatches % stages == 0
    if interleaved:
        found[f"interleaved 1F1B (v{chunks})"] = (
            chunks, {r: static_order(r, stages, chunks, microbatches) for r in range(stages)}, None)
    for name in POLICIES:
        found[f"DPP {name} (v1)"] = (1, None, name)
        if interleaved:
            found[f"DPP {name} (v{chunks})"] = (chunks, None, name)
    return found


def run(stages, microbatches, chunks, cost_kwargs, seeds):
    results = {}
    for name, (model_chunks, orders, policy) in schedules(stages, microbatches, chunks).items():
        spans, peaks = [], []
        for seed in range(seeds):
            cost = CostModel(seed=seed, **cost_kwargs)
            caps = default_caps(stages, model_chunks, microbatches, stages)
            outcome = simulate(stages, model_chunks, microbatches, cost, static_orders=orders, policy=policy,
                               caps=caps)
            spans.append(outcome.makespan_ms)
            peaks.append(outcome.peak_in_flight)
        results[name] = (statistics.mean(spans), max(peaks))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--chunks", type=int, default=2, help="model chunks per rank of the interleaved schedules")
    parser.add_argument("--forward-ms", type=float, default=1.0, help="one stage's forward of one microbatch")
    parser.add_argument("--transfer-ms", type=float, default=0.05)
    parser.add_argument("--jitter-ms", type=float, default=1.0)
    parser.add_argument("--straggler-ms", type=float, default=3.0)
    parser.add_argument("--probability", type=float, default=0.3)
    parser.add_argument("--seeds", type=int, default=5, help="delay draws averaged per cell")
    options = parser.parse_args()
    for stages in options.stages:
        for label, cost_kwargs in scenarios(options, stages).items():
            print(f"\n### PP{stages}, {label}: makespan (mean of {options.seeds} draws) / peak activations\n")
            rows = {m: run(stages, m, options.chunks, cost_kwargs, options.seeds) for m in options.microbatches}
            names = list(dict.fromkeys(n for r in rows.values() for n in r))
            print("| microbatches | " + " | ".join(names) + " |")
            print("|---|" + "---|" * len(names))
            for m, result in rows.items():
                cells = [f"{result[n][0]:.1f} / {result[n][1]}" if n in result else "n/a" for n in names]
                print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
