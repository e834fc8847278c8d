"""Small numeric helpers shared by the detection stages."""

import numpy as np


def median(values):
    return float(np.median(values)) if len(values) else 0.0


def overlap(start, end, other_start, other_end):
    return max(0.0, min(end, other_end) - max(start, other_start))
