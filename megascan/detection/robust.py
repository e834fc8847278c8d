"""Robust statistics shared by the detection stages."""

import numpy as np

MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation is 1.4826 x its MAD


def median(values):
    return float(np.median(values)) if len(values) else 0.0


def mad(values):
    values = np.asarray(values, dtype=np.float64)
    return float(np.median(np.abs(values - np.median(values)))) if values.size else 0.0


def overlap(start, end, other_start, other_end):
    return max(0.0, min(end, other_end) - max(start, other_start))
