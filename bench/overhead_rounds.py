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


def summary(round_ratios, bootstrap=False):
    """{"median_percent", "mean_percent", "std_error_percent"} of per-round ratios (the error None for one round),
    with "median_std_error_percent" where ``bootstrap``: the spread of the median over resamples of the rounds
    (seeded: the same rounds give the same figure)."""
    figure = {"median_percent": statistics.median(round_ratios) * 100,
              "mean_percent": statistics.mean(round_ratios) * 100,
              "std_error_percent": (statistics.stdev(round_ratios) / len(round_ratios) ** 0.5 * 100
                                    if len(round_ratios) > 1 else None)}
    if bootstrap:
        draw = random.Random(0)
        medians = [statistics.median(draw.choices(round_ratios, k=len(round_ratios)))
                   for _ in range(BOOTSTRAP_RESAMPLES)]
        figure["median_std_error_percent"] = statistics.stdev(medians) * 100 if len(round_ratios) > 1 else None
    return figure
