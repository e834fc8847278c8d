"""A competing job on one GPU for the benchmarks: scripts/gpu_load.py, started and stopped from Python."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts/gpu_load.py"


def start_gpu_load(gpu, duty):
    """scripts/gpu_load.py on ``gpu`` at ``duty``, returned once its GEMMs run (its first line); the caller stops it
    with ``terminate()`` and ``wait()``."""
    load = subprocess.Popen([sys.executable, str(SCRIPT), "--gpu", str(gpu), "--duty", str(duty)],
                            stdout=subprocess.PIPE, text=True)
    if not load.stdout.readline().startswith("gpu_load: "):
        sys.exit(f"{Path(sys.argv[0]).name}: scripts/gpu_load.py did not start on GPU {gpu} (exit {load.wait()})")
    return load
