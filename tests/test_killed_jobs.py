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
# A round's job is killed at most two iterations past where it resumed (see _moment): room for every round, then
# the last run, uninterrupted, to the end.
ITERATIONS = 2 * ROUNDS + 4
MARK = "MEGATRON_KILLED_JOB_TEST"  # in the environment of every process of a round's job (inherited)
JOB = TINY_GPT + ["--num-layers", "1", "--mock-data", "--vocab-size", "1000", "--tensor-model-parallel-size", "2",
                  "--train-iters", ITERATIONS]
TRACKER = "latest_checkpointed_iteration.txt"
_LOADED = re.compile(r"loaded checkpoint \S+/iter_(\d+) ")
# A traceback's frame of any process but torchrun (whose report of a failed worker is a traceback of its own, from
# torch.distributed and the runpy that started it).
_FOREIGN_FRAME = re.compile(r'File "(?![^"]*/torch/distributed/|<frozen runpy>)[^"]*", line')


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


def _moment(resumes_at, rng):
    """The line after which a round's job is killed (a random delay later): in its start-up (the checkpoint
    loaded), in its first save (megatron-core spawns its result-queue manager then), or one iteration later, in an
    iteration or a save."""
    first = (resumes_at or 0) + 1
    loaded = "no checkpoint in" if resumes_at is None else "loaded checkpoint"
    return rng.choice([loaded, f" iteration {first:8d}/", f"saved checkpoint at iteration {first} ",
                       f" iteration {first + 1:8d}/"])


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
        moment, alive = _moment(resumes_at, rng), []

        def kill_at_a_random_moment(launcher, how=how, mark=mark, alive=alive):
            time.sleep(rng.uniform(0, 0.3))
            _kill(how, launcher, rng)
            alive.extend(_alive_after(mark, 10))

        result = job_acted_on(torchrun_command(2, "pretrain_gpt.py", flags), moment, kill_at_a_random_moment,
                              env={MARK: mark}, timeout=120)
        output, where = result.stdout, (round_, how, moment, resumes_at)
        assert not alive, (where, [(p.pid, p.cmdline()) for p in alive], output[-3000:])
        assert "is being written by another job" not in output, (where, output[-3000:])
        loaded = _LOADED.findall(output)
        assert loaded == ([] if resumes_at is None else [f"{resumes_at:07d}"]), (where, output[-3000:])
        losses = lm_losses(output)
        assert not losses or min(losses) == (resumes_at or 0) + 1, (where, sorted(losses))
        assert {i: reference[i] for i in losses} == losses, (where, output[-3000:])
        assert not _FOREIGN_FRAME.search(output), (where, output[-3000:])
    final = torchrun(2, "pretrain_gpt.py", flags)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    losses = lm_losses(final.stdout)
    assert losses and max(losses) == ITERATIONS and {i: reference[i] for i in losses} == losses


def _kill_a_checkpoint_writer(launcher):
    """SIGKILL the first checkpoint writer that rank 0 forks (a child running rank 0's own command) from now on."""
    rank_0 = worker_of_rank(launcher.pid, 0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in rank_0.children():
            try:
                if child.cmdline() == rank_0.cmdline():
                    child.kill()
                    return
            except psutil.Error:  # it ended meanwhile (its part written)
                continue
    raise AssertionError("rank 0 forked no checkpoint writer within 60 s")


def test_a_killed_checkpoint_writer_ends_its_rank_in_one_line_not_a_save_that_waits_forever(tmp_path):
    """megatron-core's save waits for each writer it forks to report; one killed never does, and the rank waited
    for it forever (its peer in the barrier after the save too)."""
    for attempt in range(3):
        flags = JOB + ["--save", tmp_path / f"save{attempt}", "--save-interval", 1]
        result = job_acted_on(torchrun_command(2, "pretrain_gpt.py", flags), "saved checkpoint at iteration 1 ",
                              _kill_a_checkpoint_writer, timeout=120)
        # A writer killed as it finished was collected by megatron-core before the rank could see how it ended: the
        # save had its part, and the job rightly went on. Only then is the kill tried again, on a new job.
        if result.returncode != 0:
            break
    lines = [line for line in result.stdout.splitlines() if line.startswith("pretrain_gpt.py: ")]
    assert result.returncode != 0, result.stdout[-3000:]
    assert len(lines) == 1 and re.fullmatch(r"pretrain_gpt.py: error: a process that rank 0 started \(pid \d+: a "
                                            r"checkpoint writer, .*\) was killed by SIGKILL; rank 0 stops .*",
                                            lines[0]), result.stdout[-3000:]
    assert not _FOREIGN_FRAME.search(result.stdout), result.stdout[-3000:]
