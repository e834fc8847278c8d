"""MegaFBD against the normal run: iteration time and per-instance peak memory, printed as a table.

Each case is a real pretrain_gpt.py launch under torchrun on mock data; the normal runs use full
recomputation (the run FBD's staleness 0 reproduces). While a job runs, every worker's host RSS is
sampled (psutil, 0.2 s); GPU peaks come from the log (the last rank's log line for a normal run,
the per-instance ``megafbd: ... done`` lines for FBD). The iteration time is the median of the log
lines after the first two iterations.

    python bench/megafbd_bench.py --device cpu                    # CPU: PP1 and PP2, normal vs FBD
    python bench/megafbd_bench.py --device cuda --cases gpu       # one GPU: FBD forward on the CPU
    python bench/megafbd_bench.py --device cuda --cases gpu --model 1.3b --rounds 2 --only recomputation,FBD:

``--rounds`` runs the chosen cases again in the same order, so that cases compared with each other alternate
on the same machine (a host-bound run's time moves with the host). ``--load-duty`` runs
``scripts/gpu_load.py`` on GPU 0 beside every case (a GPU shared with another job).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from competing_load import start_gpu_load

REPO = Path(__file__).resolve().parents[1]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
FBD = ["--forward-backward-disaggregating"]
PP2 = ["--pipeline-model-parallel-size", "2"]

CASES = {  # name: (processes, flags)
    "cpu": {
        "normal PP1": (1, RECOMPUTE),
        "FBD PP1": (2, RECOMPUTE + FBD),
        "normal PP2": (2, RECOMPUTE + PP2),
        "FBD PP2": (4, RECOMPUTE + FBD + PP2),
        "FBD PP2 staleness 1": (4, RECOMPUTE + FBD + PP2 + ["--fbd-weight-staleness", "1"]),
    },
    "gpu": {
        "normal (GPU, no recomputation)": (1, []),
        "normal (GPU, full recomputation)": (1, RECOMPUTE),
        "FBD: backward GPU, forward CPU": (2, RECOMPUTE + FBD + ["--fbd-forward-device", "cpu"]),
        "FBD staleness 1: backward GPU, forward CPU": (
            2, RECOMPUTE + FBD + ["--fbd-forward-device", "cpu", "--fbd-weight-staleness", "1"]),
    },
}

MODELS = {  # --model: "cpu" and "gpu" are the cases' defaults
    "cpu": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
            "--max-position-embeddings", "256", "--micro-batch-size", "4", "--global-batch-size", "16"],
    "gpu": ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "1024",
            "--max-position-embeddings", "1024", "--micro-batch-size", "8", "--global-batch-size", "64", "--bf16"],
    # Without CUDA graphs (recomputation turns them off) the host bounds the two models above on an H200: its
    # speed, which varies between runs, sets their times. The GPU bounds GPT 1.3B's.
    "1.3b": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--micro-batch-size", "4", "--global-batch-size", "16", "--bf16"],
    "345m": ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
             "--max-position-embeddings", "1024", "--micro-batch-size", "8", "--global-batch-size", "64", "--bf16"],
}

_ITERATION_MS = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")
_INSTANCE = re.compile(r"megafbd: (\w+) instance \(stage (\d+), replica (\d+), tensor rank (\d+)\) "
                       r"\(global rank (\d+)\)"
                       r".*peak (GPU memory|host RSS) (\d+) MB")
_NORMAL_GPU = re.compile(r"peak memory \(MB\): (\d+)")


def _worker_ranks(launcher):
    ranks = {}
    for child in launcher.children(recursive=True):
        try:  # a child may end (or be a zombie, a NoSuchProcess) between the listing and these reads
            rank = child.environ().get("RANK")
            if rank is not None and "pretrain_gpt.py" in " ".join(child.cmdline()):
                ranks[child.pid] = (int(rank), child)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ranks


def run_case(nproc, flags, common, timeout):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master-port", str(29500 + os.getpid() % 1000), str(REPO / "pretrain_gpt.py"), *common, *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    peaks = {}
    with tempfile.TemporaryFile("w+") as errors, subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                                                   stderr=errors, text=True) as job:
        launcher, start = psutil.Process(job.pid), time.time()
        output = []
        reader = threading.Thread(target=lambda: output.extend(job.stdout), daemon=True)
        reader.start()
        while job.poll() is None and time.time() - start < timeout:
            for _pid, (rank, process) in _worker_ranks(launcher).items():
                try:
                    peaks[rank] = max(peaks.get(rank, 0), process.memory_info().rss)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.2)
        if job.poll() is None:
            job.kill()
        reader.join(timeout=10)
        errors.seek(0)
        error_tail = errors.read()[-1500:]
    log = "".join(output)
    if job.returncode != 0:
        print(f"(exit {job.returncode}; the end of its stderr:)\n{error_tail}", file=sys.stderr)
    times = [float(ms) for it, ms in _ITERATION_MS.findall(log) if int(it) > 2]
    return job.returncode, (statistics.median(times) if times else None), peaks, log


def describe_ranks(nproc, flags, peaks, log):
    """(rank label, host RSS MB, GPU MB or '') per process."""
    instances = {int(m[4]): m for m in _INSTANCE.findall(log)}
    rows = []
    for rank in range(nproc):
        label, gpu = f"rank {rank}", ""
        if rank in instances:
            kind, stage, replica, tensor, _, memory_kind, megabytes = instances[rank]
            label = f"{kind} stage {stage}"
            gpu = megabytes if memory_kind == "GPU memory" else ""
        elif rank == nproc - 1 and _NORMAL_GPU.search(log):
            gpu = _NORMAL_GPU.findall(log)[-1]
        rows.append((label, peaks.get(rank, 0) / 2**20, gpu))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--cases", choices=list(CASES), default=None, help="default: cpu on CPU, gpu on cuda")
    parser.add_argument("--model", choices=list(MODELS), default=None, help="default: the cases' own")
    parser.add_argument("--only", default="", help="comma-separated substrings: run the cases whose name has one")
    parser.add_argument("--rounds", type=int, default=1, help="run the cases this many times, alternating")
    parser.add_argument("--load-duty", type=float, default=0.0, help="a competing load on GPU 0 (0: none)")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--timeout", type=int, default=150, help="seconds per case")
    args = parser.parse_args()
    cases = args.cases or ("cpu" if args.device == "cpu" else "gpu")
    model = MODELS[args.model or cases]
    chosen = {name: case for name, case in CASES[cases].items()
              if not args.only or any(part in name for part in args.only.split(","))}
    if not chosen:
        parser.error(f"--only {args.only!r} matches none of: {', '.join(CASES[cases])}")
    common = model + [
        "--device", args.device, "--mock-data", "--vocab-size", "32000", "--train-iters", str(args.iterations),
        "--lr", "1e-4", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0"]
    load = f"; scripts/gpu_load.py on GPU 0 at duty {args.load_duty}" if args.load_duty else ""
    print(f"model: {' '.join(model)}; {args.iterations} iterations; median ms/iteration after the 2nd{load}")
    print("| round | case | processes | ms / iteration | per process: peak host RSS MB (GPU MB) |")
    print("|---|---|---|---|---|")
    competing = start_gpu_load(0, args.load_duty) if args.load_duty else None
    try:
        for round_ in range(1, args.rounds + 1):
            for name, (nproc, flags) in chosen.items():
                code, ms, peaks, log = run_case(nproc, flags, common, args.timeout)
                per_rank = "; ".join(f"{label} {rss:.0f}" + (f" ({gpu})" if gpu else "")
                                     for label, rss, gpu in describe_ranks(nproc, flags, peaks, log))
                shown = f"{ms:.0f}" if ms is not None else f"failed (exit {code})"
                print(f"| {round_} | {name} | {nproc} | {shown} | {per_rank} |", flush=True)
    finally:
        if competing is not None:
            competing.terminate()
            competing.wait()


if __name__ == "__main__":
    main()
