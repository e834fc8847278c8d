"""Issue 64: a SIGKILL anywhere in a job leaves nothing behind, and the restart resumes where the tracker says.

A TP2 job (real torchrun, gloo) saving every iteration is killed at a random moment, round after round, in each of
the ways a job dies: its launcher's process group (a job controller's ``kill -9 -- -PGID``), the launcher alone,
one rank, every process of it at once. Each time, within 10 s no process of the job is alive (its ranks, their
checkpoint writers and multiprocessing helpers: every process holding the round's environment mark), and the
restart, started at once, is not refused by the --save lock, loads the checkpoint that the tracker names and
computes the losses of the uninterrupted run.
"""

import os
import random
import re
import signal
import time

import psutil
from helpers.launch import TINY_GPT, job_acted_on, lm_losses, torchrun, torchrun_command, worker_of_rank

ROUNDS = 10
ITERATIONS = 30
MARK = "MEGATRON_KILLED_JOB_TEST"  # in the environment of every process of a round's job (inherited)
JOB = TINY_GPT + ["--num-layers", "2", "--mock-data", "--vocab-size", "1000", "--tensor-model-parallel-size", "2",
                  "--train-iters", ITERATIONS]
TRACKER = "latest_checkpointed_iteration.txt"
_LOADED = re.compile(r"loaded checkpoint \S+/iter_(\d+) ")


def _processes_marked(mark):
    marked = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARK) == mark and process.status() != psutil.STATUS_ZOMBIE:
                marked.append(process)
        except psutil.Error:  # another user's, or gone meanwhile
            continue
    return marked


def _alive_after(mark, seconds):
    """The processes of the job still alive ``seconds`` after now (as soon as there are none: [])."""
    deadline = time.monotonic() + seconds
    while (alive := _processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _kill(how, launcher, rng):
    if how == "launcher's process group":  # the launcher runs in a session of its own (job_acted_on)
        os.killpg(launcher.pid, signal.SIGKILL)
    elif how == "launcher":
        launcher.kill()
    elif how == "one rank":
        worker_of_rank(launcher.pid, rng.randrange(2)).kill()
    else:  # every process of the job, by pid, at once
        for process in [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]:
            process.kill()


def test_a_job_killed_anywhere_leaves_nothing_and_its_restart_resumes_with_the_same_losses(tmp_path):
    reference = lm_losses(torchrun(2, "pretrain_gpt.py", JOB).stdout)
    assert sorted(reference) == list(range(1, ITERATIONS + 1)), reference
    save = tmp_path / "save"
    flags = JOB + ["--save", save, "--load", save, "--save-interval", 1]
    rng = random.Random(64)
    ways = ["launcher's process group", "launcher", "one rank", "every process"]
    for round_ in range(ROUNDS):
        how, mark = ways[round_ % len(ways)], f"{os.getpid()}-{round_}"
        tracker = save / TRACKER
        resumes_at = int(tracker.read_text()) if tracker.exists() else None
        alive = []

        def kill_at_a_random_moment(launcher, how=how, mark=mark, alive=alive):
            time.sleep(rng.uniform(0, 0.6))  # into the iteration or its save: anywhere
            _kill(how, launcher, rng)
            alive.extend(_alive_after(mark, 10))

        result = job_acted_on(torchrun_command(2, "pretrain_gpt.py", flags), "| consumed samples:",
                              kill_at_a_random_moment, env={MARK: mark}, timeout=120)
        output = result.stdout
        assert not alive, (round_, how, [(p.pid, p.cmdline()) for p in alive], output[-3000:])
        assert "is being written by another job" not in output, (round_, output[-3000:])
        loaded = _LOADED.findall(output)
        assert loaded == ([] if resumes_at is None else [f"{resumes_at:07d}"]), (round_, resumes_at, output[-3000:])
        losses = lm_losses(output)
        assert losses and min(losses) == (resumes_at or 0) + 1, (round_, resumes_at, sorted(losses))
        assert {i: reference[i] for i in losses} == losses, (round_, how)
        assert not re.search(r'File "[^"]*/(megatron|megadpp|megafbd|tools)/', output), output[-3000:]
    final = torchrun(2, "pretrain_gpt.py", flags)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    losses = lm_losses(final.stdout)
    assert losses and max(losses) == ITERATIONS and {i: reference[i] for i in losses} == losses
