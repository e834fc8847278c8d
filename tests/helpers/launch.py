"""Launch the real entry points as a user would (torchrun, gloo on CPU) and read their logs."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megatron.training.ports import free_port

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"  # what holds the helpers package
PLUGINS = TESTS / "helpers" / "plugins"  # plugin modules for MEGATRON_PLUGINS (on PYTHONPATH)

# A tiny GPT on the sample vocabulary; no dropout and layout-invariant initialization so that
# every parallel layout computes the same losses.
TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization",
    "--device", "cpu", "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0",
    "--split", "98,2,0",
]


def gpt_data_args(prefix):
    return ["--data-path", str(prefix), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(REPO / "datasets/gpt/vocab.json"),
            "--merge-file", str(REPO / "datasets/gpt/merges.txt")]


def torchrun_command(nproc, script, args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master-port", str(free_port()), str(REPO / script), *map(str, args)]


def kill_process_tree(pid, timeout=10):
    """SIGKILL a process and all its descendants, and wait until the descendants are gone (the caller
    collects the process itself).

    torchrun starts every worker in a session of its own, so killing torchrun's process group
    leaves the workers running (a SIGSTOPped one stays stopped) long after the test.
    """
    root = psutil.Process(pid)
    descendants = root.children(recursive=True)  # before the kill, which hands them to init
    for process in (root, *descendants):
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(descendants, timeout=timeout)


def worker_of_rank(launcher_pid, rank):
    """The worker process of ``rank`` (its RANK) among a torchrun launcher's descendants."""
    for process in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if process.environ().get("RANK") == str(rank) and "LOCAL_RANK" in process.environ():
                return process
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker of rank {rank}")


def running_with_argument(text):
    """Pids of the running processes whose command line holds ``text`` (e.g. a test's own directory)."""
    return [process.pid for process in psutil.process_iter(["cmdline", "status"])
            if text in " ".join(process.info["cmdline"] or ()) and process.info["status"] != psutil.STATUS_ZOMBIE]


def child_env(extra=None):
    """The environment of a process a test starts: this one's, with ``extra``; PYTHONPATH has tests/ first, so
    that an entry script run by its path imports ``helpers`` as the tests do, the repository (for the
    benchmark harnesses some entry scripts drive, ``bench.dpp_schedules``), then ``extra``'s and this
    process's own (a PYTHONPATH in ``extra``, e.g. a folder of plugins, adds to it: it replaces nothing)."""
    extra = dict(extra or {})
    paths = [str(TESTS), str(REPO), extra.pop("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    return env


def torchrun(nproc, script, args, env=None, timeout=600):
    """Run to completion; returns the CompletedProcess (stdout and stderr as text). A job that runs
    past ``timeout`` is killed with its workers before the error is raised."""
    command = torchrun_command(nproc, script, args)
    with subprocess.Popen(command, cwd=REPO, env=child_env(env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as job:
        try:
            stdout, stderr = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_process_tree(job.pid)  # not yet collected, so the pid is still the job's
            raise
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


def run_script(script, args, env=None, timeout=120):
    """One process, no launcher: how a mistyped command is usually first run."""
    env = {"MASTER_PORT": str(free_port()), **(env or {})}
    return subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=REPO,
                          env=child_env(env), capture_output=True, text=True, timeout=timeout)


def run_script_cases(script, cases, timeout=300, env=None):
    """``run_script`` for many (args, env) cases of one script at once: each case in a process forked after
    the script's imports (tests/helpers/fork_runner.py), so that the imports are paid once; ``env``: the
    environment of those imports (a PYTHONPATH for a script's sibling modules). CompletedProcess each."""
    payload = json.dumps([{"args": list(map(str, args)), "env": {"MASTER_PORT": str(free_port()), **(env or {})}}
                          for args, env in cases])
    runner = subprocess.run([sys.executable, str(REPO / "tests/helpers/fork_runner.py"), str(REPO / script)], cwd=REPO,
                            env=child_env(env), input=payload, capture_output=True, text=True, timeout=timeout)
    assert runner.returncode == 0, runner.stderr[-5000:]
    return [subprocess.CompletedProcess([script, *args], result["returncode"], result["stdout"], result["stderr"])
            for (args, _), result in zip(cases, json.loads(runner.stdout))]


_ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+)")


def job_acted_on(command, marker, act, env=None, timeout=300):
    """``command`` (a torchrun launch, in a session of its own) with ``act(launcher)`` run once a line contains
    ``marker`` (while the job surely runs). Returns the CompletedProcess (stdout: the whole output, stderr
    included); no process is left behind if it fails first."""
    launcher = subprocess.Popen(command, cwd=REPO, env=child_env(env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = []
    try:
        deadline = time.time() + timeout
        for line in launcher.stdout:
            output.append(line)
            if marker in line:
                act(launcher)
                break
            assert time.time() < deadline, "".join(output)
        output.append(launcher.communicate(timeout=timeout)[0])
    finally:
        if launcher.returncode is None:
            kill_process_tree(launcher.pid)
            launcher.wait()
    return subprocess.CompletedProcess(command, launcher.returncode, "".join(output))


def preempted_run(command, marker, ctrl_c=False, env=None, timeout=300):
    """The whole output of ``command`` once a line contains ``marker``, it was sent SIGTERM, as a scheduler's
    preemption does, or (``ctrl_c``) SIGINT to its process group, as Ctrl-C in a terminal does."""
    def stop(launcher):
        if ctrl_c:
            os.killpg(launcher.pid, signal.SIGINT)
        else:
            launcher.send_signal(signal.SIGTERM)
    return job_acted_on(command, marker, stop, env, timeout).stdout


def lm_losses(output):
    """{iteration: lm loss} from the training log lines."""
    return {int(i): float(loss) for i, loss in _ITERATION_LINE.findall(output)}


def assert_succeeded(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
