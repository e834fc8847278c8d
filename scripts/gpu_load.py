"""A competing workload that slows one GPU without touching its clocks: back-to-back GEMMs.

    python scripts/gpu_load.py --gpu N [--size 8192] [--duty 1.0] [--period-ms 100]
                               [--duration SECONDS] [--dtype bf16|fp16|fp32] [--pid-file PATH]

Within every period it computes for duty x period and then sleeps, so --duty sets how much of
the GPU it takes. It stops after --duration seconds or on SIGTERM/SIGINT and prints a summary.
"""

import argparse
import os
import signal
import sys
import threading
import time

import torch

from megatron.training.atomic_file import replaced_on_success

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _fail(message):
    print(f"gpu_load.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="gpu_load.py", description=__doc__.split("\n\n")[0])
    parser.error = _fail  # one line, not argparse's usage block: launch scripts log it
    parser.add_argument("--gpu", type=int, required=True)
    parser.add_argument("--size", type=int, default=8192, help="matrix side")
    parser.add_argument("--duty", type=float, default=1.0, help="busy fraction of each period, (0, 1]")
    parser.add_argument("--period-ms", type=float, default=100.0)
    parser.add_argument("--duration", type=float, default=None, help="seconds (default: until stopped)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--pid-file", default=None, help="write this process's PID here while it runs")
    args = parser.parse_args(argv)
    if args.size < 1:
        _fail(f"--size must be at least 1, got {args.size}")
    if not 0 < args.duty <= 1:
        _fail(f"--duty must be in (0, 1], got {args.duty}")
    if args.period_ms <= 0:
        _fail(f"--period-ms must be positive, got {args.period_ms}")
    if args.duration is not None and args.duration <= 0:
        _fail(f"--duration must be positive, got {args.duration}")
    if args.pid_file and not os.path.isdir(os.path.dirname(os.path.abspath(args.pid_file))):
        _fail(f"--pid-file {args.pid_file}: its directory does not exist")
    if not torch.cuda.is_available():
        _fail("no CUDA device: gpu_load.py needs a GPU")
    if not 0 <= args.gpu < torch.cuda.device_count():
        _fail(f"--gpu {args.gpu} does not exist (this machine has {torch.cuda.device_count()} GPUs)")
    return args


def _write_pid_file(path):
    """Rename into place, so a launch script never reads a half-written PID."""
    with replaced_on_success(path) as temporary, open(temporary, "w") as f:
        f.write(f"{os.getpid()}\n")


def _run(args, stop):
    """GEMMs for duty x period, then idle for the rest of the period; returns (GEMMs, seconds)."""
    device = torch.device("cuda", args.gpu)
    try:
        a = torch.randn(args.size, args.size, device=device, dtype=DTYPES[args.dtype])
        b, c = torch.randn_like(a), torch.empty_like(a)
    except torch.cuda.OutOfMemoryError:
        _fail(f"--size {args.size} does not fit in GPU {args.gpu}'s free memory")
    print(f"gpu_load: {args.size}x{args.size} {args.dtype} GEMMs on GPU {args.gpu} "
          f"({torch.cuda.get_device_name(device)}), duty {args.duty}, period {args.period_ms} ms, "
          f"duration {'until stopped' if args.duration is None else f'{args.duration} s'}", flush=True)
    period = args.period_ms / 1000
    started = time.perf_counter()
    deadline = float("inf") if args.duration is None else started + args.duration
    gemms = 0
    while not stop.is_set() and time.perf_counter() < deadline:
        period_start = time.perf_counter()
        busy_until = min(period_start + args.duty * period, deadline)
        while time.perf_counter() < busy_until and not stop.is_set():
            torch.mm(a, b, out=c)
            gemms += 1
            torch.cuda.synchronize(device)  # the duty is real GPU time, not queued work
        # A signal wakes this wait at once, so a long period does not delay stopping.
        stop.wait(max(0.0, min(period_start + period, deadline) - time.perf_counter()))
    return gemms, time.perf_counter() - started


def main(argv=None):
    args = _parse(argv)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if args.pid_file:
        _write_pid_file(args.pid_file)
    try:
        gemms, seconds = _run(args, stop)
    finally:
        if args.pid_file and os.path.exists(args.pid_file):
            os.remove(args.pid_file)
    print(f"gpu_load: {gemms} GEMMs in {seconds:.1f} s, "
          f"{2 * args.size ** 3 * gemms / max(seconds, 1e-9) / 1e12:.1f} TFLOP/s on average", flush=True)


if __name__ == "__main__":
    main()
