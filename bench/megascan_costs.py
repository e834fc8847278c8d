"""Host cost of MegaScan's tracing primitives on one GPU, in microseconds per call (median of repeats).

What a traced iteration pays on the training thread: a timestamp (``mark``), granularity ``full``'s
tracing of one transformer layer (forward and backward of a small megatron-core block, per layer),
a traced collective (on a one-rank NCCL group); and what the writer thread pays per recorded row
when it resolves and encodes a window.
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
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megascan.comm_tracer import CommTracer
from megascan.layer_tracer import LayerTracer
from megascan.recorder import Recorder
from megascan.timing import CudaEventTimer
from megascan.trace_writer import TraceWriter

REPEATS = 7
LAYERS = 4


def _sample_us(run, calls, prepare):
    """Host time per call of ``run(calls)``; ``prepare()`` runs untimed before it."""
    prepare()
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(calls)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _median_us(run, calls, prepare):
    """Median over REPEATS samples, after one warm-up."""
    _sample_us(run, calls, prepare)
    return statistics.median(_sample_us(run, calls, prepare) for _ in range(REPEATS))


def _added_us(bare, traced, calls, prepare):
    """(median of ``bare``, median over pairs of ``traced`` - ``bare``), samples alternating in
    pairs after one warm-up each: the difference of two medians taken apart moved by tens of us
    from run to run."""
    _sample_us(bare, calls, prepare)
    _sample_us(traced, calls, prepare)
    pairs = [(_sample_us(bare, calls, prepare), _sample_us(traced, calls, prepare)) for _ in range(3 * REPEATS)]
    return statistics.median(b for b, _ in pairs), statistics.median(t - b for b, t in pairs)


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


def layer_cost(recorder):
    """Forward and backward of a small transformer block, per layer: (bare, added by granularity
    ``full``'s layer tracer)."""
    config = TransformerConfig(num_layers=LAYERS, hidden_size=64, num_attention_heads=4)
    bare, traced = (TransformerBlock(config, get_gpt_layer_local_spec()).cuda() for _ in range(2))
    LayerTracer(recorder, [traced]).install()
    source = torch.randn(16, 2, 64, device="cuda", requires_grad=True)

    def runner(block):
        def run(calls):
            for _ in range(calls):
                block(hidden_states=source * 1.0, attention_mask=None).sum().backward()
        return run
    bare_us, added_us = _added_us(runner(bare), runner(traced), 100, lambda: _fresh_window(recorder))
    return bare_us / LAYERS, added_us / LAYERS


def collective_cost(recorder):
    """A small all-reduce on a one-rank NCCL group: (bare, added by recording it)."""
    tracer = CommTracer(recorder)
    tensor = torch.ones(1024, device="cuda")

    def bare(calls):
        for _ in range(calls):
            dist.all_reduce(tensor)

    def traced(calls):
        tracer.install()
        bare(calls)
        tracer.uninstall()
    return _added_us(bare, traced, 1000, lambda: _fresh_window(recorder))


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
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    layer_us, layer_added_us = layer_cost(recorder)
    collective_us, collective_added_us = collective_cost(recorder)
    figures = {"mark_us": mark_cost(recorder), "layer_us": layer_us, "layer_added_us": layer_added_us,
               "collective_us": collective_us, "collective_added_us": collective_added_us,
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
