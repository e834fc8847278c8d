"""A side-by-side benchmark's figure from its rounds: each round's mode against the same round's reference, as
a ratio minus one, summarised as the median over rounds (its standard error by bootstrap) and the mean with its
standard error. Rounds of a host-paced job include a few slow outliers: the median is the figure, the mean says
how much they move it. (bench/megascan_overhead.py writes the rounds; bench/megascan_overhead_pool.py pools runs.)
"""

import random
import statistics

BOOTSTRAP_RESAMPLES = 2000


def ratios(values, reference):
    return [value / ref - 1 for value, ref in zip(values, reference)]


def interval_ms(rounds):
    """Each interval's whole time: its iterations and the writer's drain after them."""
    return [sum(r["traced"]) + sum(r["untraced"]) + r["drain"] for r in rounds]


def single_iterations_ms(rounds):
    """Every iteration of the intervals, one list."""
    return [t for r in rounds for t in r["traced"] + r["untraced"]]


def off_iteration_ms(off_rounds):
    """The reference of each round's iterations: the mean iteration of that round's `off` interval."""
    return [statistics.mean(r["traced"] + r["untraced"]) for r in off_rounds]


def round_ratios(runs, mode):
    """{figure: [one ratio per round]} of ``mode`` against `off` in a benchmark's ``runs`` ({mode: [round...]},
    each round {"traced": [ms...], "untraced": [ms...], "drain": ms}): its traced and (where the interval has
    them) untraced iterations against `off`'s mean iteration, the whole interval against `off`'s, and each
    traced position ("position 4"...) against `off`'s iteration at that position."""
    off, rounds = runs["off"], runs[mode]
    reference = off_iteration_ms(off)
    figures = {"traced": ratios([statistics.mean(r["traced"]) for r in rounds], reference)}
    if rounds[0]["untraced"]:
        figures["untraced"] = ratios([statistics.mean(r["untraced"]) for r in rounds], reference)
    figures["interval"] = ratios(interval_ms(rounds), interval_ms(off))
    first_traced = len(rounds[0]["untraced"]) + 1
    for index in range(len(rounds[0]["traced"])):
        figures[f"position {first_traced + index}"] = ratios([r["traced"][index] for r in rounds],
                                                             [r["traced"][index] for r in off])
    return figures


def summary(round_ratios, bootstrap=False):
    """{"median_percent", "mean_percent", "std_error_percent"} of per-round ratios (the error None for one round),
    with "median_std_error_percent" where ``bootstrap``: the spread of the median over resamples of the rounds
    (seeded: the same rounds give the same figure)."""
    figure = {"median_percent": statistics.median(round_ratios) * 100,
              "mean_percent": statistics.mean(round_ratios) * 100,
              "std_error_percent": (statistics.stdev(round_ratios) / len(round_ratios) ** 0.5 * 100
                                    if len(round_ratios) > 1 else None)}
    if bootstrap:
        figure["median_std_error_percent"] = None
        if len(round_ratios) > 1:
            draw = random.Random(0)
            medians = [statistics.median(draw.choices(round_ratios, k=len(round_ratios)))
                       for _ in range(BOOTSTRAP_RESAMPLES)]
            figure["median_std_error_percent"] = statistics.stdev(medians) * 100
    return figure
