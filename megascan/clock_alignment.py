"""Put every rank's timestamps on one global clock.

A trace window's times come from the rank's timer (CUDA events, or the host's perf_counter) placed on
its host's wall clock by an anchor taken for that window (megascan/timing.py). So rank r's reading in
window w is

    local = rate_r * global + offset_r + window_offset[r, w]

with a per-window offset (the anchor's error, microseconds on a GPU; a host's NTP offset, which wanders
over a long run) and one rate per rank: the drift of its timer against the reference's, which shows
only within a window. The refinement uses what the trace itself proves: the participants of one
collective finish it together. With T_k the global finish of collective instance k in window w,

    end[r, k] = T_k + o[r, w] + d_r * (T_k - c_w)      for every participant r of k,

a weighted least-squares problem that is linear once the T_k are eliminated: per window, one system in
the ranks' offsets and drifts, accumulated group by group (the instances of one process group share
their members) and solved directly, reweighted (Huber) against late returns. A drift is kept only
where it is significant (5 standard errors of the rank's within-window slopes); elsewhere the rank
keeps rate 1, so per-window anchor errors on one host are never mistaken for drift. The reference rank,
and ranks known to read the same clock (``fixed``: same host, host timer), are the gauge: not fitted.
A rank that shares no collective with the reference, directly or through other ranks, cannot be
aligned: it is reported with the reason instead of being merged.
"""

from dataclasses import dataclass, field

import numpy as np

_HUBER_US = 20.0  # residuals past this count linearly: a late return is an outlier, not a shift
_DRIFT_SIGNIFICANCE = 5.0  # standard errors a drift must stand out by to be kept
_NOISE_FLOOR_US = 0.05  # finishes never agree better than this (timer resolution)
_DRIFT_RIDGE = 1e-6  # against singular drift columns, in the units of a window's scaled slope
_SAME_FIT = 1.5  # a simpler clock model is kept while its misfit stays within this factor of the richer one's


def _median(values):
    return float(np.median(values)) if len(values) else float("nan")


@dataclass
class RankClock:
    rate: float  # local microseconds per global microsecond
    offset_us: float  # local reading at global time 0, less the window's offset
    residual_us: float  # median |misfit| of this rank's collective finishes after alignment
    collectives: int  # how many collective finishes the fit used
    window_offsets_us: dict = field(default_factory=dict)  # window -> its anchor's offset (added to offset_us)

    def window_offset(self, window):
        """The window's own offset, or the nearest fitted window's (the earlier one on a tie) for a window
        without finishes (one that stalled: its host times follow the host's clock of the windows around)."""
        if window in self.window_offsets_us or not self.window_offsets_us:
            return self.window_offsets_us.get(window, 0.0)
        if window is None:
            return next(iter(self.window_offsets_us.values()))
        return self.window_offsets_us[min(self.window_offsets_us, key=lambda w: (abs(w - window), w))]

    def to_global(self, local_us, window=None):
        return (np.asarray(local_us, dtype=np.float64) - self.offset_us - self.window_offset(window)) / self.rate

    @property
    def drift_ppm(self):
        return (self.rate - 1.0) * 1e6


@dataclass
class Alignment:
    reference_rank: int
    clocks: dict  # rank -> RankClock
    unaligned: dict = field(default_factory=dict)  # rank -> reason


def _linked(instances, start):
    """Ranks linked to ``start`` through shared collective instances: labels propagated along each instance's
    members (first to the others) until they settle, with pointer jumping, all in numpy."""
    ranks = sorted({rank for ends in instances for rank in ends} | {start})
    index = {rank: i for i, rank in enumerate(ranks)}
    first, other = [], []
    for ends in instances:
        members = [index[rank] for rank in ends]
        first += [members[0]] * (len(members) - 1)
        other += members[1:]
    first, other = np.array(first, dtype=np.int64), np.array(other, dtype=np.int64)
    labels = np.arange(len(ranks))
    while True:
        lowest = np.minimum(labels[first], labels[other])
        updated = labels.copy()
        np.minimum.at(updated, first, lowest)
        np.minimum.at(updated, other, lowest)
        updated = updated[updated]  # jump to the label's own label
        if np.array_equal(updated, labels):
            break
        labels = updated
    home = labels[index[start]]
    return {rank for rank, label in zip(ranks, labels.tolist()) if label == home}


@dataclass
class _ClockFit:
    drift: dict  # rank -> rate - 1, where significant
    offsets: dict  # rank -> {window: offset}
    misfits: dict  # rank -> |misfit| of each of its finishes


class _WindowFit:
    """The finishes of one window, one entry per member finish, and the weighted least-squares fit on them.

    The normal equations are never formed: a collective over every rank (the grad-norm all-reduce) makes
    them dense, which costs memory quadratic and a direct solve cubic in the ranks (8192 ranks: 16,384
    unknowns). Conjugate gradients apply them entry by entry instead, linear in the finishes."""

    def __init__(self, instances, ranks):
        self.index = {rank: i for i, rank in enumerate(ranks)}
        members, values, counts = [], [], []
        for ends in instances:
            members.extend(map(self.index.__getitem__, ends))
            values.extend(ends.values())
            counts.append(len(ends))
        self.member = np.array(members, dtype=np.int64)
        self.value = np.array(values, dtype=np.float64)
        self.row = np.repeat(np.arange(len(counts)), counts)
        medians = self._row_medians(np.array(counts))
        self.centre = float(np.mean(medians))
        self.scale = max(float(np.max(np.abs(medians - self.centre))), 1.0)
        self.tau = ((medians - self.centre) / self.scale)[self.row]  # in [-1, 1]: keeps the system conditioned
        self.rows = len(counts)
        self._weigh(np.ones_like(self.value))

    def _weigh(self, weight):
        """Sets the finishes' weights, and each instance's total of them: every product of conjugate gradients
        divides by it, so it is summed once per weighting rather than once per step."""
        self.weight = weight
        self.row_weight = np.bincount(self.row, weight, self.rows)

    def _row_medians(self, counts):
        """Each instance's median finish: its finishes sorted, the middle one (or two)."""
        ordered = self.value[np.lexsort((self.value, self.row))]
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        return (ordered[first + (counts - 1) // 2] + ordered[first + counts // 2]) / 2

    def _centred(self, values):
        """``values`` less the weighted mean of their instance's entries."""
        return values - (np.bincount(self.row, self.weight * values, self.rows) / self.row_weight)[self.row]

    def _by_rank(self, values):
        size = len(self.index)
        return np.bincount(self.member, values, size), np.bincount(self.member, self.tau * values, size)

    def _apply(self, offsets, drifts):
        """The normal matrix times (offsets, drifts): each finish's shift from its instance's weighted mean,
        weighted, summed per rank (and per rank times tau)."""
        return self._by_rank(self.weight * self._centred(offsets[self.member] + self.tau * drifts[self.member]))

    def _rank_blocks(self):
        """Per rank, the normal matrix's own 2 x 2 block (offset, drift): (offset-offset, offset-drift,
        drift-drift). Inverted, it preconditions the gradients: a rank's offset and drift move together."""
        own = self.weight - self.weight ** 2 / self.row_weight[self.row]
        size = len(self.index)
        return tuple(np.bincount(self.member, factor * own, size) for factor in (1.0, self.tau, self.tau ** 2))

    def solve(self, free, drift=None):
        """(offsets, drifts in scaled units) of all ranks; gauge ranks 0. ``drift`` given: offsets only."""
        size = len(self.index)
        offsets, drifts = np.zeros(size), np.zeros(size) if drift is None else drift.copy()
        if not len(free):
            return offsets, drifts
        rhs_offsets, rhs_drifts = self._by_rank(self.weight * self._centred(self.value))
        blocks = [block[free] for block in self._rank_blocks()]
        count = len(free)
        if drift is None:
            def apply(x):
                offsets[free], drifts[free] = x[:count], x[count:]
                product = self._apply(offsets, drifts)
                # A rank whose finishes in this window all fall at one moment has no slope to fit: a whisker of
                # ridge on the drifts keeps the system solvable and its drift at zero.
                return np.concatenate([product[0][free], product[1][free] + _DRIFT_RIDGE * x[count:]])

            offset_offset, offset_drift, drift_drift = blocks[0], blocks[1], blocks[2] + _DRIFT_RIDGE
            determinant = offset_offset * drift_drift - offset_drift ** 2

            def precondition(r):
                return np.concatenate([(drift_drift * r[:count] - offset_drift * r[count:]) / determinant,
                                       (offset_offset * r[count:] - offset_drift * r[:count]) / determinant])
            solution = _conjugate_gradients(apply, np.concatenate([rhs_offsets[free], rhs_drifts[free]]), precondition)
            offsets[free], drifts[free] = solution[:count], solution[count:]
        else:
            rhs = rhs_offsets - self._apply(np.zeros(size), drifts)[0]
            fixed = np.zeros(size)

            def apply(x):
                offsets[free] = x
                return self._apply(offsets, fixed)[0][free]
            offsets[free] = _conjugate_gradients(apply, rhs[free], lambda r: r / blocks[0])
        return offsets, drifts

    def residuals(self, offsets, drifts):
        """Each finish's misfit once its instance's own global finish is taken out."""
        return self._centred(self.value - offsets[self.member] - self.tau * drifts[self.member])

    def reweight(self, residuals):
        """Huber weights from the misfits; True if they changed."""
        new = np.minimum(1.0, _HUBER_US / np.maximum(np.abs(residuals), 1e-12))
        changed = not np.allclose(new, self.weight, atol=1e-3)
        self._weigh(new)
        return changed

    def misfits_by_rank(self, residuals):
        """rank index -> |misfit| of each of its finishes."""
        order = np.argsort(self.member, kind="stable")
        counts = np.bincount(self.member, minlength=len(self.index))
        return dict(enumerate(np.split(np.abs(residuals[order]), np.cumsum(counts)[:-1])))

    def slopes(self, residuals, drifts):
        """Per rank: (drift estimate, its variance), both in scaled units, from this window's points."""
        size = len(self.index)
        count = np.maximum(np.bincount(self.member, minlength=size), 1.0)
        taus, squares = np.bincount(self.member, self.tau, size), np.bincount(self.member, self.tau ** 2, size)
        spread = squares - taus ** 2 / count  # sum of squared deviations of tau
        mean_square = np.bincount(self.member, residuals ** 2, size) / count
        noise = np.maximum(np.sqrt(np.maximum(mean_square, 0.0)), _NOISE_FLOOR_US)
        variance = np.where(spread > 0, noise ** 2 / np.maximum(spread, 1e-12), np.inf)
        return drifts, variance


def _conjugate_gradients(apply, rhs, precondition, relative_tolerance=1e-13):
    """x with apply(x) = rhs (symmetric positive definite), preconditioned by ``precondition`` (an approximate
    inverse); stops at the tolerance, at most a few times the unknowns' count steps."""
    x = np.zeros_like(rhs)
    residual = rhs.copy()
    direction = precondition(residual)
    product = residual @ direction
    target = relative_tolerance * np.linalg.norm(rhs)
    for _ in range(4 * len(rhs) + 10):
        if np.linalg.norm(residual) <= target:
            break
        applied = apply(direction)
        step = product / (direction @ applied)
        x += step * direction
        residual -= step * applied
        preconditioned = precondition(residual)
        product, previous = residual @ preconditioned, product
        direction = preconditioned + (product / previous) * direction
    return x


class ClockAligner:
    """Solves per-rank offsets (per window) and drift from collective finish times; module docstring."""

    def __init__(self, reference_rank=0, max_iterations=5, tolerance_us=1e-3):
        self.reference_rank = reference_rank
        self.max_iterations = max_iterations
        self.tolerance_us = tolerance_us

    def align(self, instances, initial_offsets_us=None, windows=None, fixed=()):
        """``instances``: {instance id: {rank: local finish time in us}} for collectives seen by two or more
        ranks; ``windows``: {instance id: trace window} (default: one window); ``initial_offsets_us``: {rank:
        wall-clock estimate of its offset}, taken out before the fit; ``fixed``: ranks that read the
        reference's clock (not fitted)."""
        anchors = initial_offsets_us or {}
        initial = {rank: float(offset) - float(anchors.get(self.reference_rank, 0.0))
                   for rank, offset in anchors.items()}
        instances = {k: {r: t - initial.get(r, 0.0) for r, t in ends.items()} for k, ends in instances.items()
                     if len(ends) >= 2}
        all_ranks = {rank for ends in instances.values() for rank in ends} | set(initial)
        linked = _linked(instances.values(), self.reference_rank)
        unaligned = {rank: f"shares no collective with rank {self.reference_rank} or the ranks aligned to it"
                     for rank in sorted(all_ranks - linked)}
        ranks = sorted(linked)
        gauge = {self.reference_rank} | (set(fixed) & linked)
        usable = {key: ends for key, ends in instances.items() if all(rank in linked for rank in ends)}
        fit = self._fit(usable, windows or {}, ranks, gauge)
        if len(set((windows or {}).values())) > 1:
            # One offset per rank for the whole trace uses the span between windows to measure drift; keep
            # it if it explains the finishes as well as an offset per window does (no anchor errors to absorb).
            shared = self._fit(usable, {}, ranks, gauge)
            if all(_median(shared.misfits[r]) <= _SAME_FIT * _median(fit.misfits[r]) + _NOISE_FLOOR_US for r in ranks):
                fit = _ClockFit(shared.drift, {rank: dict.fromkeys(fit.offsets[rank], shared.offsets[rank][None])
                                               for rank in ranks}, shared.misfits)
        clocks = {rank: RankClock(1.0 + fit.drift.get(rank, 0.0), initial.get(rank, 0.0), _median(fit.misfits[rank]),
                                  len(fit.misfits[rank]), fit.offsets[rank]) for rank in ranks}
        return Alignment(self.reference_rank, clocks, unaligned)

    def _fit(self, instances, windows, ranks, gauge):
        """_ClockFit with an offset per window of ``windows`` ({instance id: window}; empty: one offset for
        the whole trace)."""
        by_window = {}
        for key, ends in instances.items():
            by_window.setdefault(windows.get(key), []).append(ends)
        # One window for the whole trace holds every instance: its ranks are all linked to the reference.
        linked = set(ranks) if not windows else None
        fits = {window: self._fit_window(members, ranks, gauge, linked) for window, members in by_window.items()}
        drift = self._significant_drift(fits, ranks, gauge)
        offsets, misfits = {rank: {} for rank in ranks}, {rank: [] for rank in ranks}
        for window, (fit, free, present, _, _) in fits.items():
            scaled = np.array([drift.get(rank, 0.0) * fit.scale for rank in ranks])
            solved, _ = fit.solve(free, scaled)
            for member, misfit in fit.misfits_by_rank(fit.residuals(solved, scaled)).items():
                misfits[ranks[member]].append(misfit)
            for rank in present:  # ranks cut off from the reference in this window take another window's offset
                offsets[rank][window] = float(solved[fit.index[rank]]) - drift.get(rank, 0.0) * fit.centre
        return _ClockFit(drift, offsets, {rank: np.concatenate(parts) if parts else np.zeros(0)
                                          for rank, parts in misfits.items()})

    def _fit_window(self, instances, ranks, gauge, linked=None):
        """(fit, free rank indices, ranks linked to the reference in it, drifts, their variances) of one window,
        reweighted to convergence."""
        fit = _WindowFit(instances, ranks)
        present = _linked(instances, self.reference_rank) if linked is None else linked
        free = np.array([fit.index[r] for r in sorted(present - gauge)], dtype=np.int64)
        offsets, drifts = fit.solve(free)
        for _ in range(self.max_iterations):
            if not fit.reweight(fit.residuals(offsets, drifts)):
                break
            new_offsets, drifts = fit.solve(free)
            if np.max(np.abs(new_offsets - offsets), initial=0.0) < self.tolerance_us:
                break
            offsets = new_offsets
        estimates, variances = fit.slopes(fit.residuals(offsets, drifts), drifts)
        return fit, free, present, estimates, variances

    def _significant_drift(self, fits, ranks, gauge):
        """rank -> drift (rate - 1) where the windows' pooled slope stands out of its noise, else absent."""
        weight_sum, weighted = np.zeros(len(ranks)), np.zeros(len(ranks))
        for fit, free, _, estimates, variances in fits.values():
            inverse = np.where(np.isfinite(variances), 1.0 / np.maximum(variances, 1e-30), 0.0) * fit.scale ** 2
            weight_sum[free] += inverse[free]
            weighted[free] += (estimates / fit.scale * inverse)[free]
        drift = {}
        for index, rank in enumerate(ranks):
            if rank in gauge or weight_sum[index] <= 0:
                continue
            value, error = weighted[index] / weight_sum[index], weight_sum[index] ** -0.5
            if abs(value) >= _DRIFT_SIGNIFICANCE * error:
                drift[rank] = float(value)
        return drift
