"""Checkpoints: resumable at another TP/PP with the losses of an uninterrupted run; SIGTERM and Ctrl-C save;
one job writes a --save directory, never backwards, and a save that fails is one line that keeps the previous one."""

import os
import re
import resource
import subprocess

import psutil
import pytest
from helpers.launch import (
    REPO,
    TINY_GPT,
    assert_succeeded,
    child_env,
    gpt_data_args,
    job_acted_on,
    lm_losses,
    preempted_run,
    run_script,
    torchrun,
    torchrun_command,
)
from helpers.readme_commands import as_launched, readme_commands

from megatron.training.arguments import parse_args
from megatron.training.errors import UserError
from megatron.training.save_dir.checkpoints import damaged_file
from megatron.training.save_dir.checks import checkpoint_size_estimate
from megatron.training.save_dir.lock import LOCK_FILENAME, release_save_locks, take_save_lock
from megatron.training.tokenizer import build_tokenizer
from megatron.training.validate_args import validate_args

TRACKER = "latest_checkpointed_iteration.txt"


def _train(nproc, data, iterations, *flags):
    result = torchrun(nproc, "pretrain_gpt.py", TINY_GPT + gpt_data_args(data) + ["--train-iters", iterations, *flags])
    assert_succeeded(result)
    return result


def test_checkpoint_saved_at_tp2_resumes_at_pp2_with_uninterrupted_losses(gpt_data, tmp_path):
    uninterrupted = lm_losses(_train(1, gpt_data, 6).stdout)
    _train(2, gpt_data, 6, "--tensor-model-parallel-size", "2", "--save", tmp_path, "--exit-interval", "3")
    assert (tmp_path / TRACKER).read_text() == "3"
    assert sorted(os.listdir(tmp_path)) == [LOCK_FILENAME, "iter_0000003", TRACKER]  # nothing left .inprogress
    resumed = _train(2, gpt_data, 6, "--pipeline-model-parallel-size", "2", "--load", tmp_path)
    assert "starting at iteration 3" in resumed.stdout
    losses = lm_losses(resumed.stdout)
    assert sorted(losses) == [4, 5, 6]
    for iteration in (4, 5, 6):
        assert losses[iteration] == pytest.approx(uninterrupted[iteration], rel=1e-3), \
            (iteration, losses, uninterrupted)


def test_distributed_optimizer_checkpoint_in_bf16_resumes_at_another_layout(gpt_data, tmp_path):
    flags = ["--bf16", "--use-distributed-optimizer"]
    tp2_dp2, pp2_dp2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
    uninterrupted = lm_losses(_train(4, gpt_data, 4, *flags, *tp2_dp2).stdout)
    _train(4, gpt_data, 4, *flags, *tp2_dp2, "--save", tmp_path, "--exit-interval", "2")
    losses = lm_losses(_train(4, gpt_data, 4, *flags, *pp2_dp2, "--load", tmp_path).stdout)
    assert sorted(losses) == [3, 4]
    for iteration in (3, 4):
        # bf16 weights; a run that dropped the optimizer state is 2.6 % off at iteration 4
        assert losses[iteration] == pytest.approx(uninterrupted[iteration], rel=2e-3)


def test_checkpoint_with_a_truncated_shard_is_one_line_naming_the_file_and_the_iteration_to_load(gpt_data, tmp_path):
    _train(1, gpt_data, 3, "--save", tmp_path, "--save-interval", "2")  # iterations 2 and 3
    shard = next((tmp_path / "iter_0000003").glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as damaged:  # as a full disk or an interrupted copy leaves it
        damaged.truncate(size // 2)
    result = run_script("pretrain_gpt.py",
                        TINY_GPT + gpt_data_args(gpt_data) + ["--train-iters", "4", "--load", tmp_path])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"pretrain_gpt.py: error: --load: checkpoint {tmp_path}/iter_0000003 is damaged: {shard} is cut short "
        f"({size // 2} of {size} bytes); other iterations saved there: 2; write one of them into "
        f"{tmp_path / TRACKER} to resume from it, or remove --load to train from scratch"]


def test_a_checkpoint_of_another_model_is_refused_naming_each_differing_flag(gpt_data, tmp_path):
    """Another head count used to load silently (and train at a loss of 9.7 instead of 6.2); another hidden size
    failed with megatron-core's 85-line exception."""
    _train(1, gpt_data, 3, "--save", tmp_path)
    result = run_script("pretrain_gpt.py", TINY_GPT + gpt_data_args(gpt_data) + [
        "--train-iters", "4", "--load", tmp_path, "--num-attention-heads", "8", "--swiglu"])
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"pretrain_gpt.py: error: --load: {tmp_path}/iter_0000003 holds another model: "
        f"--num-attention-heads 4 there, 8 here; --num-query-groups 4 there, 8 here; --kv-channels 16 there, "
        f"8 here; --swiglu off there, on here; launch with the model flags it was saved with"]



def test_ctrl_c_on_the_readme_training_command_saves_a_checkpoint_that_resumes_at_another_layout(tmp_path):
    """Ctrl-C in a terminal (SIGINT to torchrun's process group; torchrun passes it on to every rank) used to
    print a KeyboardInterrupt traceback per rank and save nothing; it now stops as SIGTERM does (preemption
    by SIGTERM to torchrun: tests/test_megafbd.py). The README's own commands are run, its loader workers
    (2 by default) included."""
    prepare = as_launched(readme_commands("Prepare data")[0], {"--output-prefix": tmp_path / "gpt"})
    subprocess.run(prepare, cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
    data, save = tmp_path / "gpt_text_document", tmp_path / "ckpt"
    train = readme_commands("Train")[0]
    # torchrun kills ranks that have not exited 30 s after the signal (--shutdown-timeout): on a loaded CI
    # machine the save can take longer, and a killed save leaves only iter_*.inprogress.
    log = preempted_run(as_launched(train, {"--data-path": data, "--save": save, "--train-iters": 10000}),
                        "iteration        5/", ctrl_c=True,  # the README logs every 5 iterations
                        env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300"})
    stopped = re.search(r"SIGINT received: stopping at iteration (\d+)", log)
    assert stopped, log[-3000:]
    assert "[rank" not in log and "KeyboardInterrupt" not in log, log[-3000:]  # no rank's traceback
    saved = int(stopped.group(1))
    assert (save / TRACKER).read_text() == str(saved)
    assert sorted(os.listdir(save)) == sorted([LOCK_FILENAME, f"iter_{saved:07d}", TRACKER])  # nothing left .inprogress
    resumed = subprocess.run(as_launched(train, {
        "--nproc_per_node": 2, "--pipeline-model-parallel-size": 1, "--data-path": data, "--save": tmp_path / "more",
        "--train-iters": saved + 1, "--log-interval": 1}) + ["--load", save],
        check=False, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert_succeeded(resumed)
    assert f"starting at iteration {saved}" in resumed.stdout
    assert sorted(lm_losses(resumed.stdout)) == [saved + 1]


def _validated(flags, world_size=1):
    args = parse_args(TINY_GPT + flags, "pretrain_gpt.py")
    return validate_args(args, world_size)


def _workers(launcher):
    return [p for p in psutil.Process(launcher.pid).children(recursive=True)
            if "pretrain_gpt.py" in " ".join(p.cmdline())]


def test_one_job_writes_a_save_dir_and_a_failed_save_keeps_the_previous_checkpoint(gpt_data, tmp_path):
    """Issue 31: a second job on the same --save mixed both runs' tensors into one checkpoint; a full disk failed
    the save with a trace ("unexpected pos 704 vs 598") and left iter_*.inprogress; a fresh run rewound the tracker."""
    save = tmp_path / "ckpt"
    flags = gpt_data_args(gpt_data) + ["--tensor-model-parallel-size", "2"]
    command = torchrun_command(2, "pretrain_gpt.py", TINY_GPT + flags + [
        "--train-iters", "10000", "--save", save, "--save-interval", "2"])
    refusals = []

    def second_writer_then_full_disk(launcher):
        with pytest.raises(UserError) as refusal:  # what a second job's rank 0 runs at its start
            take_save_lock(str(save))
        refusals.append(str(refusal.value))
        for worker in _workers(launcher):  # from now on every write past 64 KiB fails, as on a full disk
            resource.prlimit(worker.pid, resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    # The next save, at iteration 4 (or 6 if 4 was written before the limit), fails and ends the job.
    job = job_acted_on(command, "saved checkpoint at iteration 2", second_writer_then_full_disk)
    log = job.stdout
    assert re.fullmatch(rf"--save {save} is being written by another job \(host \S+, pid \d+, started \S+\); two jobs "
                        r"saving into one directory mix their checkpoints: wait for it to end or give another --save",
                        refusals[0]), refusals
    saved = [int(i) for i in re.findall(r"saved checkpoint at iteration (\d+)", log)]
    errors = {line for line in log.splitlines() if line.startswith("pretrain_gpt.py: error: ")}
    assert job.returncode != 0 and len(errors) == 1, log[-5000:]
    failed = re.fullmatch(
        rf"pretrain_gpt.py: error: --save: the checkpoint of iteration (\d+) could not be written into {save} "
        r"\(.+; [0-9.e+]+ GB free there: a full disk or a directory that refuses writes fails "
        rf"so\); removed the partial iter_\d{{7}}.inprogress; iteration {saved[-1]} stays the latest checkpoint; free "
        r"space or give another --save, then resume with --load", errors.pop())
    assert failed and int(failed.group(1)) > saved[-1], log[-5000:]
    assert "Traceback" not in "".join(line for line in log.splitlines(True) if line.startswith("[rank"))
    assert (save / TRACKER).read_text() == str(saved[-1])
    assert sorted(os.listdir(save)) == sorted([LOCK_FILENAME, TRACKER, *(f"iter_{i:07d}" for i in saved)])
    assert damaged_file(str(save / f"iter_{saved[-1]:07d}")) is None

    # The job is gone, and its lock with it; the lock is held again until released.
    take_save_lock(str(save))
    release_save_locks()
    # A fresh run into this directory would rewind its tracker: refused, naming what is there.
    with pytest.raises(UserError, match=rf"--save {save} already holds checkpoints \(iterations "
                                        rf"{', '.join(map(str, saved))}; the latest is {saved[-1]}\) and this run "
                                        r"starts at iteration 0 \(no --load\).*add --override-save"):
        _validated(flags + ["--train-iters", "4", "--save", str(save)], world_size=2)
    # The start-up's free-space check estimates a checkpoint of this model within 20 %.
    args = _validated(flags + ["--train-iters", "4"], world_size=2)
    build_tokenizer(args)  # pads the vocabulary
    size = sum(f.stat().st_size for f in (save / f"iter_{saved[-1]:07d}").iterdir())
    assert checkpoint_size_estimate(args) == pytest.approx(size, rel=0.2)
