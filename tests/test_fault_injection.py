"""The fault-injection helpers refuse bad input with one clear line before acting, and
gpu_control.sh locks and unlocks exactly what it should.

gpu_control.sh runs against a fake nvidia-smi that records its arguments (two GPUs, 1980 MHz at
most) and a fake `id` that reports the uid a test needs, so root and non-root paths both run
here without a GPU and without privileges. gpu_load.py's checks run with CUDA switched off or
faked; its GEMM loop needs a real GPU.
"""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.launch import REPO

CONTROL = REPO / "scripts/gpu_control.sh"
USAGE = "usage: gpu_control.sh limit <gpu> <MHz> | reset <gpu> | monitor [seconds]"
BASH = shutil.which("bash")

FAKE_NVIDIA_SMI = r"""#!/bin/sh
echo "$*" >> "$FAKE_NVIDIA_SMI_LOG"
case "$*" in
    *--query-gpu=index\ *) echo 0; echo 1 ;;
    *--query-gpu=clocks.max.sm\ *) echo 1980 ;;
    *--format=csv,noheader)
                   echo "2026/11/22 05:00:01.000, 1, 900 MHz, 1980 MHz, 310.50 W, 61, 100 %, 0x0000000000000000" ;;
    *--format=csv) echo "timestamp, index, clocks.current.sm [MHz], ..."
                   echo "2026/11/22 05:00:00.000, 1, 900 MHz, 1980 MHz, 310.50 W, 61, 100 %, 0x0000000000000000" ;;
esac
"""


class FakeGpuMachine:
    """A PATH with the fake nvidia-smi and id, and a private state directory for gpu_control.sh."""

    def __init__(self, root):
        self.bin = root / "bin"
        self.bin.mkdir()
        self.log = root / "nvidia-smi.log"
        self.log.touch()
        self.runtime = root / "runtime"
        self.runtime.mkdir()
        self.state_dir = self.runtime / "megascan-gpu-control"
        for name, text in (("nvidia-smi", FAKE_NVIDIA_SMI), ("id", '#!/bin/sh\necho "$FAKE_UID"\n')):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)

    def run(self, *args, uid=0, path=None):
        env = {**os.environ, "PATH": path or f"{self.bin}{os.pathsep}{os.environ['PATH']}",
               "XDG_RUNTIME_DIR": str(self.runtime), "FAKE_NVIDIA_SMI_LOG": str(self.log), "FAKE_UID": str(uid)}
        return subprocess.run([BASH, str(CONTROL), *args], env=env, capture_output=True, text=True, timeout=30)

    def calls(self):
        return self.log.read_text().splitlines()

    def clock_calls(self):
        """The calls that change clocks; queries leave the GPU as it was."""
        return [call for call in self.calls() if "-lgc" in call or "-rgc" in call]


@pytest.fixture
def gpus(tmp_path):
    return FakeGpuMachine(tmp_path)


def _one_error_line(result):
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("args", [[], ["lock", "1", "900"], ["limit", "1"], ["limit", "1", "900", "5"],
                                  ["reset"], ["reset", "1", "2"], ["monitor", "1", "2"]])
def test_control_usage_errors(gpus, args):
    result = gpus.run(*args)
    assert result.returncode == 2
    assert _one_error_line(result) == USAGE
    assert gpus.calls() == []


@pytest.mark.parametrize("args, message", [
    (["limit", "x", "900"], "gpu must be a non-negative integer, got 'x'"),
    (["limit", "-1", "900"], "gpu must be a non-negative integer, got '-1'"),
    (["limit", "1", "9e2"], "MHz must be a non-negative integer, got '9e2'"),
    (["limit", "1", "12345678"], "MHz must be a non-negative integer, got '12345678'"),
    (["reset", "one"], "gpu must be a non-negative integer, got 'one'"),
    (["monitor", "1.5"], "seconds must be a non-negative integer, got '1.5'"),
    (["monitor", "0"], "seconds must be at least 1, got '0'"),
])
def test_control_rejects_non_integers(gpus, args, message):
    assert _one_error_line(gpus.run(*args)) == f"gpu_control.sh: {message}"
    assert gpus.calls() == []


@pytest.mark.parametrize("args", [["limit", "1", "900"], ["reset", "1"], ["monitor", "2"]])
def test_control_needs_nvidia_smi(gpus, tmp_path, args):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _one_error_line(gpus.run(*args, path=str(empty))) == \
        "gpu_control.sh: nvidia-smi not found: this needs an NVIDIA driver"


@pytest.mark.parametrize("args", [["limit", "2", "900"], ["reset", "2"]])
def test_control_rejects_a_gpu_that_does_not_exist(gpus, args):
    assert _one_error_line(gpus.run(*args)) == "gpu_control.sh: GPU 2 does not exist (GPUs here: 0 1)"
    assert gpus.clock_calls() == []


@pytest.mark.parametrize("mhz", ["0", "1981", "5000"])
def test_control_rejects_a_clock_outside_the_gpu_range(gpus, mhz):
    assert _one_error_line(gpus.run("limit", "1", mhz)) == \
        f"gpu_control.sh: {mhz} MHz is outside GPU 1's SM clock range (1..1980 MHz)"
    assert gpus.clock_calls() == []


def test_limit_locks_the_sm_clock_and_remembers_it(gpus):
    result = gpus.run("limit", "1", "900")
    assert result.returncode == 0, result.stderr
    assert gpus.clock_calls() == ["-i 1 -lgc 900,900"]
    assert (gpus.state_dir / "limited-1").read_text() == "900\n"
    assert "gpu_control.sh reset 1" in result.stdout


def test_limit_and_reset_need_root(gpus):
    assert _one_error_line(gpus.run("limit", "1", "900", uid=1000)) == \
        "gpu_control.sh: run as root (sudo): locking clocks needs administrator rights"
    assert not (gpus.state_dir / "limited-1").exists()
    assert gpus.run("limit", "1", "900").returncode == 0
    assert "run as root (sudo)" in _one_error_line(gpus.run("reset", "1", uid=1000))
    assert gpus.clock_calls() == ["-i 1 -lgc 900,900"]
    assert (gpus.state_dir / "limited-1").exists()


def test_reset_refuses_a_gpu_it_did_not_limit(gpus):
    assert gpus.run("limit", "1", "900").returncode == 0
    line = _one_error_line(gpus.run("reset", "0"))
    assert line.startswith("gpu_control.sh: GPU 0 was not limited by gpu_control.sh")
    assert gpus.clock_calls() == ["-i 1 -lgc 900,900"]


def test_reset_unlocks_what_limit_locked_once(gpus):
    assert gpus.run("limit", "1", "900").returncode == 0
    result = gpus.run("reset", "1")
    assert result.returncode == 0, result.stderr
    assert gpus.clock_calls() == ["-i 1 -lgc 900,900", "-i 1 -rgc"]
    assert not (gpus.state_dir / "limited-1").exists()
    assert "was not limited" in _one_error_line(gpus.run("reset", "1"))
    assert len(gpus.clock_calls()) == 2


def test_limit_refuses_a_planted_state_directory(gpus, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    gpus.state_dir.symlink_to(elsewhere)
    assert "belongs to another user" in _one_error_line(gpus.run("limit", "1", "900"))
    assert gpus.clock_calls() == []


def test_monitor_prints_a_header_then_one_row_a_second(gpus):
    result = gpus.run("monitor", "2")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 3  # header + a row for each of the 2 seconds
    queries = gpus.calls()
    assert [q.rsplit("--format=", 1)[1] for q in queries] == ["csv", "csv,noheader"]
    fields = queries[0].split("--query-gpu=")[1].split()[0].split(",")
    assert {"index", "clocks.sm", "clocks.max.sm", "power.draw", "temperature.gpu", "utilization.gpu",
            "clocks_throttle_reasons.active"} <= set(fields)


def _load_gpu_load():
    spec = importlib.util.spec_from_file_location("gpu_load", REPO / "scripts/gpu_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_load = _load_gpu_load()


def _gpu_load_error(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_load.main(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flags, message", [
    (["--size", "0"], "--size must be at least 1, got 0"),
    (["--duty", "0"], "--duty must be in (0, 1], got 0.0"),
    (["--duty", "1.5"], "--duty must be in (0, 1], got 1.5"),
    (["--duration", "0"], "--duration must be positive, got 0.0"),
    (["--duration", "-5"], "--duration must be positive, got -5.0"),
    (["--period-ms", "0"], "--period-ms must be positive, got 0.0"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--pid-file", "/no/such/dir/load.pid"], "--pid-file /no/such/dir/load.pid: its directory does not exist"),
])
def test_gpu_load_rejects_bad_flags_before_looking_for_a_gpu(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _gpu_load_error(["--gpu", "0", *flags], capsys).startswith(f"gpu_load.py: error: {message}")


def test_gpu_load_needs_the_gpu_flag(capsys):
    assert "required: --gpu" in _gpu_load_error([], capsys)


@pytest.mark.parametrize("gpu", ["2", "-1"])
def test_gpu_load_rejects_a_gpu_that_does_not_exist(gpu, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _gpu_load_error(["--gpu", gpu], capsys) == \
        f"gpu_load.py: error: --gpu {gpu} does not exist (this machine has 2 GPUs)"


def test_gpu_load_without_cuda_exits_2_with_one_line():
    result = subprocess.run([sys.executable, str(REPO / "scripts/gpu_load.py"), "--gpu", "0", "--duration", "1"],
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr == "gpu_load.py: error: no CUDA device: gpu_load.py needs a GPU\n"
    assert result.stdout == ""


def test_gpu_load_pid_file_holds_the_pid_and_nothing_is_left_beside_it(tmp_path):
    path = tmp_path / "load.pid"
    path.write_text("an older run's\n")
    gpu_load._write_pid_file(str(path))
    assert path.read_text() == f"{os.getpid()}\n" and os.listdir(tmp_path) == ["load.pid"]


def test_forward_delays_are_decided_per_chunk_and_forward():
    """The slow-stage / slow-host delay of MegaScan and MegaDPP (megatron/training/fault_injection.py): each
    chunk's forwards are counted apart, and ``when`` sees each (chunk, n) before the forward runs."""
    from megatron.training.fault_injection import sleep_before_each_forward

    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    asked = []

    def when(chunk, n):
        asked.append((chunk, n))
        return False

    sleep_before_each_forward(chunks, 1.0, when)
    x = torch.zeros(1, 2)
    for chunk in (0, 1, 1, 0, 1):
        chunks[chunk](x)
    assert asked == [(0, 0), (1, 0), (1, 1), (0, 1), (1, 2)]
