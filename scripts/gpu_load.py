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
import tempfile
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _fail(message):
    print(f"gpu_load.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="gpu_load.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", type=int, required=True)
    parser.add_argument("--size", type=int, default=8192, help="matrix side")
    parser.add_argument("--duty", type=float, default=1.0, help="busy fraction of each period, (0, 1]")
    parser.add_argument("--period-ms", type=float, default=100.0)
    parser.add_argument("--duration", type=float, default=None, help="seconds (default: until stopped)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--pid-file", default=None)
    args = parser.parse_args(argv)
    if args.size < 1:
        _fail(f"--size must be at least 1, got {args.size}")
    if not 0 < args.duty <= 1:
        _fail(f"--duty must be in (0, 1], got {args.duty}")
    if args.period_ms <= 0:
        _fail(f"--period-ms must be positive, got {args.period_ms}")
    if args.duration is not None and args.duration <= 0:
        _fail(f"--duration must be positive, got {args.duration}")
    if not torch.cuda.is_available():
        _fail("no CUDA device: gpu_load.py needs a GPU")
    if not 0 <= args.gpu < torch.cuda.device_count():
        _fail(f"--gpu {args.gpu} does not exist (this machine has {torch.cuda.device_count()} GPUs)")
    return args


def _write_pid_file(path):
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(handle, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(temporary, path)


def main(argv=None):
    args = _parse(argv)
    stop = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.append(True))
    if args.pid_file:
        _write_pid_file(args.pid_file)
    device = torch.device("cuda", args.gpu)
    a = torch.randn(args.size, args.size, device=device, dtype=DTYPES[args.dtype])
    b = torch.randn_like(a)
    print(f"gpu_load: GEMMs of {args.size}x{args.size} {args.dtype} on GPU {args.gpu} "
          f"({torch.cuda.get_device_name(device)}), duty {args.duty}, period {args.period_ms} ms", flush=True)
    period = args.period_ms / 1000
    started = time.perf_counter()
    gemms = 0
    try:
        while not stop and (args.duration is None or time.perf_counter() - started < args.duration):
            period_start = time.perf_counter()
            while time.perf_counter() - period_start < args.duty * period and not stop:
                torch.mm(a, b)
                gemms += 1
                torch.cuda.synchronize(device)  # the duty is real GPU time, not queued work
            time.sleep(max(0.0, period - (time.perf_counter() - period_start)))
    finally:
        if args.pid_file and os.path.exists(args.pid_file):
            os.remove(args.pid_file)
    seconds = time.perf_counter() - started
    print(f"gpu_load: {gemms} GEMMs in {seconds:.1f} s, {2 * args.size ** 3 * gemms / seconds / 1e12:.1f} TFLOP/s",
          flush=True)


if __name__ == "__main__":
    main()
