"""Issue 31: outputs that cannot be written fail at start-up in one line, not after the work (in-process checks
of the launch's validation; tests/test_checkpointing.py runs the lock and a failing save in a real job)."""

import subprocess
import sys

import psutil
import pytest
from helpers.launch import REPO

from megadpp.arguments import add_arguments as add_dpp_arguments
from megadpp.arguments import validate_args as validate_dpp_args
from megatron.training.arguments import parse_args
from megatron.training.errors import UserError
from megatron.training.save_dir.checks import short_of_space_warning
from megatron.training.save_dir.lock import release_save_locks, take_save_lock
from megatron.training.validate_args import validate_args

MOCK = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "3", "--mock-data", "--vocab-size", "1000",
        "--device", "cpu"]
# root writes anywhere a permission bit forbids: sysfs refuses new files to everyone
READ_ONLY_DIR = "/sys"


def _validate(*flags):
    args = parse_args(MOCK + [str(flag) for flag in flags], "pretrain_gpt.py", add_dpp_arguments)
    validate_args(args, 2 if "--use-dpp" in flags else 1)
    validate_dpp_args(args)
    return args


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("user data")
    return path


@pytest.mark.parametrize("flags, expected", [
    (["--save", "{file}"], "--save {file} is a file; give a directory you can write to"),
    (["--save", "{file}/ckpt"],
     "--save {file}/ckpt is under {file}, which is a file; give a directory you can write to"),
    (["--save", f"{READ_ONLY_DIR}/ckpt"], (f"--save {READ_ONLY_DIR}/ckpt cannot be written: creating a file in "
                                           f"{READ_ONLY_DIR} fails (Permission denied); give a directory you can "
                                           f"write to")),
    (["--tensorboard-dir", READ_ONLY_DIR], (f"--tensorboard-dir {READ_ONLY_DIR} cannot be written: creating a file "
                                            f"in {READ_ONLY_DIR} fails (Permission denied)")),
    (["--tensorboard-dir", "{file}"], "--tensorboard-dir {file} is a file"),
    (["--use-dpp", "--pipeline-model-parallel-size", "2", "--dpp-log-schedule", "{dir}"],
     "--dpp-log-schedule {dir} is a directory; give the path of a new file"),
    (["--use-dpp", "--pipeline-model-parallel-size", "2", "--dpp-log-schedule", "{file}"],
     "--dpp-log-schedule {file} already exists and would be overwritten; remove it or give a new file name"),
    (["--use-dpp", "--pipeline-model-parallel-size", "2", "--dpp-log-schedule", "{file}/schedule.json"],
     "--dpp-log-schedule {file}/schedule.json: its directory {file} is a file; give a path you can write to"),
])
def test_an_output_that_cannot_be_written_is_one_line_at_start(tmp_path, a_file, flags, expected):
    names = {"file": a_file, "dir": tmp_path}
    with pytest.raises(UserError) as refusal:
        _validate(*(flag.format(**names) for flag in flags))
    assert str(refusal.value).startswith(expected.format(**names))
    assert a_file.read_text() == "user data" and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_writable_outputs_pass_and_nothing_is_created_before_the_job_starts(tmp_path):
    _validate("--save", tmp_path / "new" / "ckpt", "--tensorboard-dir", tmp_path / "tb",
              "--use-dpp", "--pipeline-model-parallel-size", "2", "--dpp-log-schedule", tmp_path / "schedule.json")
    assert list(tmp_path.iterdir()) == []


def _saved(root, iterations, tracker):
    for iteration in iterations:
        (root / f"iter_{iteration:07d}").mkdir(parents=True)
    if tracker is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(str(tracker))
    return root


def test_a_run_that_would_move_the_save_tracker_backwards_is_refused_unless_asked(tmp_path):
    save = _saved(tmp_path / "save", [10, 15], 15)
    earlier = _saved(tmp_path / "earlier", [10], 10)
    for flags, start in (([], "0 (no --load)"), (["--load", save, "--finetune"], "0 (--finetune)"),
                         (["--load", earlier], f"10 (--load {earlier})")):
        with pytest.raises(UserError) as refusal:
            _validate("--save", save, *flags)
        assert str(refusal.value) == (
            f"--save {save} already holds checkpoints (iterations 10, 15; the latest is 15) and this run starts at "
            f"iteration {start}: its saves would make earlier iterations the latest ones; resume with --load {save}, "
            f"give a new --save directory, or add --override-save to save there anyway")
        _validate("--save", save, *flags, "--override-save")
    _validate("--save", save, "--load", save)  # resuming: the tracker only moves forward
    (save / "latest_checkpointed_iteration.txt").write_text("10")  # the user picked 10 to resume from
    _validate("--save", save, "--load", save)


def test_the_save_lock_names_its_holder_and_dies_with_it(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import sys; from megatron.training.save_dir.lock import take_save_lock; "
                                f"take_save_lock({str(tmp_path)!r}); print('locked', flush=True); sys.stdin.read()")],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(UserError, match=rf"--save {tmp_path} is being written by another job \(host \S+, pid "
                                            rf"{holder.pid}, started "):
            take_save_lock(str(tmp_path))
    finally:
        holder.kill()  # as a crashed job: nothing releases the lock but the kernel
        holder.wait()
    take_save_lock(str(tmp_path))
    release_save_locks()


_FORKING_HOLDER = """
import os, sys
from megatron.training.job_lifetime import set_parent_death_signal
from megatron.training.save_dir.lock import take_save_lock
take_save_lock(sys.argv[1])
if os.fork() == 0:  # a helper that outlives its parent (as a checkpoint writer blocked on its queue did)
    set_parent_death_signal(0)
    print(os.getpid(), flush=True)  # after the fork's handlers ran in it
    sys.stdin.read()
    os._exit(0)
sys.stdin.read()
"""


def test_a_process_the_holder_forked_does_not_keep_the_save_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _FORKING_HOLDER, str(tmp_path)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(holder.stdout.readline()))
    try:
        holder.kill()
        holder.wait()
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        take_save_lock(str(tmp_path))  # the child's copy of the file was closed when it was forked
        release_save_locks()
    finally:
        child.kill()


def test_a_disk_with_less_room_than_one_checkpoint_is_warned_of(tmp_path):
    warning = short_of_space_warning(str(tmp_path / "ckpt"), needed_bytes=10 ** 18)
    assert warning.startswith(f"warning: --save {tmp_path / 'ckpt'}: ") and "less than the 1e+09 GB" in warning
    assert short_of_space_warning(str(tmp_path / "ckpt"), needed_bytes=1) is None
