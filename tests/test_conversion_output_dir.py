"""Where a conversion writes, checked in-process (tests/test_hf_conversion.py runs the tool itself, signals and
a full disk included): a parent that takes nothing and a full disk are one line naming --save-dir, leaving
nothing; of what interrupted conversions left, only a dead conversion's of this host is removed."""

import os
import socket
import subprocess

import pytest

from megatron.training.errors import UserError
from megatron.training.save_dir.conversion_output import written_atomically
from megatron.training.save_dir.conversion_staging import remove_leftovers


def test_a_parent_that_takes_nothing_is_one_line_and_nothing_is_made(tmp_path):
    a_file = tmp_path / "weights.bin"
    a_file.write_text("")
    with pytest.raises(UserError) as refused, written_atomically(str(a_file / "deeper" / "out")):
        pytest.fail("went on")
    assert str(refused.value) == (f"--save-dir {a_file / 'deeper' / 'out'}: cannot create it in {a_file / 'deeper'} "
                                  f"(Not a directory); choose another --save-dir")
    # /sys refuses a new directory even to root (chmod would not): read-only, or not permitted
    with pytest.raises(UserError, match=r"^--save-dir /sys/megatronapp-out: cannot create it in /sys \((Read-only "
                                        r"file system|Operation not permitted|Permission denied)\); choose another "
                                        r"--save-dir$"), written_atomically("/sys/megatronapp-out"):
        pytest.fail("went on")
    assert list(tmp_path.iterdir()) == [a_file]


def test_a_full_disk_is_one_line_naming_the_save_dir_and_nothing_is_left(tmp_path):
    out = tmp_path / "new" / "out"
    with pytest.raises(UserError) as refused, written_atomically(str(out)) as work_dir:
        weights = os.path.join(work_dir, "weights")
        os.symlink("/dev/full", weights)  # writing there fails as on a full disk: ENOSPC
        with open(weights, "wb") as f:
            f.write(b"tensor")
    assert str(refused.value) == (f"--save-dir {out}: writing in {out.parent} failed (No space left on device); "
                                  f"nothing was written: free space there or choose another --save-dir")
    assert list(tmp_path.iterdir()) == []  # new/ too: it was made for the output


def test_only_what_a_dead_conversion_of_this_host_left_is_removed(tmp_path):
    with subprocess.Popen(["true"]) as ended:
        pass
    host = socket.gethostname()
    left = tmp_path / f".out.converting-{host}-{ended.pid}"
    kept = [tmp_path / f".out.converting-{host}-{os.getppid()}",  # a conversion that runs
            tmp_path / f".out.converting-elsewhere-{ended.pid}",  # another host's: not known here
            tmp_path / ".out.converting-k3j9x0a1",  # not our naming (an earlier converter's random suffix)
            tmp_path / f"out.converting-{host}-{ended.pid}"]  # a user's directory, not hidden
    for directory in (left, *kept):
        directory.mkdir()
        (directory / "weights").write_text("data")
    (tmp_path / ".out.converting").symlink_to(left.name)  # the dead conversion's claim on out
    (tmp_path / ".new.converting").symlink_to(left.name)  # a claim on another target: not its
    (tmp_path / f".notes.converting-{host}-{ended.pid}").write_text("a user's file")
    kept += [tmp_path / ".new.converting", tmp_path / f".notes.converting-{host}-{ended.pid}"]
    remove_leftovers(str(tmp_path))
    assert sorted(tmp_path.iterdir()) == sorted(kept)
    assert all((directory / "weights").read_text() == "data" for directory in kept[:4])
