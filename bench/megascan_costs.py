"""Host cost of MegaScan's tracing primitives on one GPU, in microseconds per call (median of repeats).

What a traced iteration pays on the training thread: a timestamp (``mark``), the hooks around one
layer part (forward and backward of a module), a traced collective (on a one-rank NCCL group);
and what the writer thread pays per recorded row when it resolves and encodes a window.
Run on the GPU machine:

    python bench/megascan_costs.py [--json out.json]
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megascan.comm_tracer import CommTracer  # noqa: E402
from megascan.compute_tracer import _LayerPhase  # noqa: E402
from megascan.layer_hooks import hook_phases  # noqa: E402
from megascan.recorder import Recorder  # noqa: E402
from megascan.timing import CudaEventTimer  # noqa: E402
from megascan.trace_writer import TraceWriter  # noqa: E402

REPEATS = 7


def _median_us(run, calls, prepare):
    """Median over REPEATS of the host time per call of ``run(calls)``, after one warm-up;
    ``prepare()`` runs untimed before each."""
    samples = []
    for repeat in range(REPEATS + 1):
        prepare()
        torch.cuda.synchronize()
        start = time.perf_counter()
        run(calls)
        if repeat:
            samples.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _fresh_window(recorder):
    """Open a new window, giving the last window's marks back to the pool as the writer would (a pool
    that runs dry creates events, which would be timed too)."""
    window = recorder.window
    if window is not None:
        marks = [window.base_mark, *(m for row in window.events for m in row[5:7]),
                 *(m for r in window.ops for m in (r.start, r.end) if m is not None)]
        recorder.timer.pool.extend({id(m): m for m in marks}.values())
    recorder.open_window(0, [1])


def mark_cost(recorder):
    timer, marks = recorder.timer, []

    def run(calls):
        marks.extend(timer.mark() for _ in range(calls))

    def give_back():
        timer.pool.extend(marks)
        marks.clear()
    return _median_us(run, 2000, give_back)


def layer_part_cost(recorder, hooked):
    """Forward and backward of a small module; with ``hooked`` the tracer's layer hooks observe it."""
    module = torch.nn.Linear(64, 64, device="cuda")
    if hooked:
        hook_phases(module, _LayerPhase(recorder, "mlp-forward", 1), _LayerPhase(recorder, "mlp-backward", 1))
    source = torch.randn(8, 64, device="cuda", requires_grad=True)

    def run(calls):
        for _ in range(calls):
            module(source * 1.0).sum().backward()
    return _median_us(run, 300, lambda: _fresh_window(recorder))


def collective_cost(recorder, traced):
    """A small all-reduce on a one-rank NCCL group; with ``traced`` the op is recorded."""
    tracer = CommTracer(recorder)
    tensor = torch.ones(1024, device="cuda")

    def run(calls):
        if traced:
            tracer.install()
        for _ in range(calls):
            dist.all_reduce(tensor)
        if traced:
            tracer.uninstall()
    return _median_us(run, 1000, lambda: _fresh_window(recorder))


def writer_row_cost(recorder, path):
    """Writer-thread time per event row: resolve two CUDA marks and encode the row."""
    writer = TraceWriter(path, {"type": "metadata"}, recorder)
    rows = 4000
    samples = []
    for _ in range(REPEATS):
        _fresh_window(recorder)
        for _ in range(rows):
            recorder.add_event("mlp-forward", recorder.timer.mark(), recorder.timer.mark(), layer=1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        writer.submit(recorder.close_window(), complete=True)
        writer.drain()
        samples.append((time.perf_counter() - start) / rows * 1e6)
    writer.close()
    os.remove(path)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/megascan_costs.py: error: no CUDA GPU here; it measures CUDA-event tracing")
    torch.cuda.init()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    recorder = Recorder(CudaEventTimer(torch.cuda.current_device()))
    recorder.timer.pool.extend(torch.cuda.Event(enable_timing=True) for _ in range(20000))
    bare = layer_part_cost(recorder, hooked=False)
    hooked = layer_part_cost(recorder, hooked=True)
    untraced_op = collective_cost(recorder, traced=False)
    figures = {"mark_us": mark_cost(recorder), "layer_part_bare_us": bare, "layer_part_hooked_us": hooked,
               "layer_part_added_us": hooked - bare, "collective_us": untraced_op,
               "collective_added_us": collective_cost(recorder, traced=True) - untraced_op,
               "writer_us_per_row": writer_row_cost(recorder, f"/tmp/megascan_costs_{os.getpid()}.json"),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print("megascan costs: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in figures.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
