"""Host time that MegaScope's training mode adds to each iteration when nobody is connected.

    torchrun --nproc_per_node 1 bench/megascope_training_host_cost.py <pretrain_gpt.py flags> --training-ws-port P

Runs pretrain_gpt.py's training in this process with the plugin's two per-iteration entry points timed: its
wrapper around the forward-backward schedule (time in the wrapper minus time in the schedule it wraps) and its
end-of-iteration hook (statistics when streaming, the control point). Prints, after the first 5 iterations, the
mean added host time per iteration against the mean iteration time (wall time between iteration ends). On the
critical path this host time is an upper bound on the cost; an A/B of whole runs (bench/
megascope_training_overhead.sh) cannot resolve a cost far below its run-to-run spread.
"""

import sys
import time

import pretrain_gpt
from megascope.plugin import MegaScopePlugin

WARM_UP = 5
added: list[float] = []  # per training iteration: the host time MegaScope added (s)
iteration_ends: list[float] = []  # perf_counter at each iteration's end


def _timed_wrap_schedule(wrap_schedule):
    def wrap(self, context, schedule):
        inside = [0.0]

        def timed_schedule(*a, **k):
            start = time.perf_counter()
            try:
                return schedule(*a, **k)
            finally:
                inside[0] = time.perf_counter() - start

        wrapped = wrap_schedule(self, context, timed_schedule)

        def run(*a, **k):
            start = time.perf_counter()
            result = wrapped(*a, **k)
            if not k.get("forward_only"):
                added.append(time.perf_counter() - start - inside[0])
            return result
        return run
    return wrap


def _timed_iteration_end(on_iteration_end):
    def end(self, context, iteration, metrics):
        start = time.perf_counter()
        on_iteration_end(self, context, iteration, metrics)
        now = time.perf_counter()
        added[-1] += now - start
        iteration_ends.append(now)
    return end


def main():
    MegaScopePlugin.wrap_schedule = _timed_wrap_schedule(MegaScopePlugin.wrap_schedule)
    MegaScopePlugin.on_iteration_end = _timed_iteration_end(MegaScopePlugin.on_iteration_end)
    pretrain_gpt.main()
    kept = added[WARM_UP:len(iteration_ends)]
    intervals = [b - a for a, b in zip(iteration_ends[WARM_UP:], iteration_ends[WARM_UP + 1:])]
    if not kept or not intervals:
        sys.exit(f"too few iterations to measure: run more than {WARM_UP + 1} with --training-ws-port")
    host_ms, iteration_ms = 1000 * sum(kept) / len(kept), 1000 * sum(intervals) / len(intervals)
    print(f"MegaScope training mode, nobody connected: {host_ms:.3f} ms of host time added per iteration, "
          f"iteration {iteration_ms:.1f} ms: {100 * host_ms / iteration_ms:.3f} % "
          f"({len(kept)} iterations after {WARM_UP})", flush=True)


if __name__ == "__main__":
    main()
