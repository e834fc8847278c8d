"""MegaDPP's transport (csrc/megadpp_transport, megadpp/transport): real processes under torchrun (gloo)."""

import os
import secrets
import shutil
import subprocess
import sys

import pytest
from helpers.launch import REPO, assert_succeeded, torchrun

from megadpp.transport import cuda_ipc_available
from megadpp.transport._shm import segment_bytes
from megadpp.transport.rendezvous import remove_abandoned_segments, segment_name

WORKER = "tests/helpers/transport_worker.py"
SHM = "/dev/shm"


def test_exchange_matches_gloo_for_every_dtype_shape_and_order():
    """Four ranks, every pair both ways: dtypes, empty / 0-d / non-contiguous / multi-slot tensors,
    many outstanding transfers on a 4-slot ring, per-tag order, observer events; shared memory,
    torch.distributed and the two together (--multi-node over two simulated nodes) all equal to
    plain gloo send/recv."""
    result = torchrun(4, WORKER, ["exchange"], timeout=500)
    assert_succeeded(result)
    for rank in range(4):
        for kind in ("shared memory", "torch.distributed", "routed (--multi-node)"):
            assert f"rank {rank}: {kind} exchange matches gloo" in result.stdout


@pytest.mark.skipif(not cuda_ipc_available(), reason="needs a GPU and the CUDA IPC part of the extension")
def test_cuda_ipc_exchange_between_two_processes_on_one_gpu():
    """Two ranks on cuda:0 (or one GPU each where there are two): every dtype and shape, in order."""
    result = torchrun(2, WORKER, ["cuda-ipc"], timeout=400)
    assert_succeeded(result)
    for rank in range(2):
        assert f"rank {rank}: CUDA IPC exchange on cuda:" in result.stdout


@pytest.mark.skipif(not cuda_ipc_available(), reason="needs a GPU and the CUDA IPC part of the extension")
def test_cuda_ipc_copies_follow_the_compute_streams_on_both_sides():
    """Sends of tensors still being computed, overwritten once their sends complete; received tensors used by
    queued work and dropped: 200 rounds, every value right (a missing stream wait would change some)."""
    result = torchrun(2, WORKER, ["cuda-ipc-race"], timeout=400)
    assert_succeeded(result)
    for rank in range(2):
        assert f"rank {rank}: CUDA IPC under busy streams: 200 rounds right" in result.stdout


def run_segments(pids):
    return [name for name in os.listdir(SHM) if any(name.startswith(f"megadpp-{pid}-") for pid in pids)]


def test_sigkill_leaves_nothing_in_dev_shm_and_spares_foreign_segments(tmp_path):
    foreign = os.path.join(SHM, f"megadpp-{secrets.token_hex(6)}-not-ours")  # the prefix, but not the run's
    with open(foreign, "w") as f:
        f.write("someone else's")
    try:
        result = torchrun(2, WORKER, ["sigkill", "--out-dir", tmp_path], timeout=400)
        assert result.returncode != 0
        assert "rank 1: killing myself with sends outstanding" in result.stdout, result.stderr[-3000:]
        pids = [(tmp_path / f"pid-{rank}").read_text() for rank in range(2)]
        assert run_segments(pids) == []
        assert os.path.exists(foreign)
    finally:
        os.unlink(foreign)


def test_segments_a_killed_job_left_are_removed_by_the_next_transport_and_live_ones_kept():
    """A job killed while its channels were set up leaves its segments (created, never opened): the next transport
    on the node removes those whose creator is gone, and only those."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    abandoned, live = (os.path.join(SHM, segment_name(0, 1).replace(f"-{os.getpid()}-", f"-{pid}-")[1:])
                       for pid in (ended.pid, os.getpid()))
    for path in (abandoned, live):
        with open(path, "w") as f:
            f.write("a channel")
    try:
        remove_abandoned_segments()
        assert not os.path.exists(abandoned) and os.path.exists(live)
    finally:
        for path in (abandoned, live):
            if os.path.exists(path):
                os.unlink(path)


def test_too_little_dev_shm_is_one_line_naming_the_size_needed():
    result = torchrun(2, WORKER, ["too-small"], timeout=300)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "megadpp transport: /dev/shm has" in line]
    assert lines, result.stderr[-3000:]
    needed = segment_bytes(8, 1 << 20)  # one peer: one outgoing channel of 8 slots of 1 MiB
    assert (f"/dev/shm has 1048576 bytes free (capped at 1048576 bytes) but the 1 channel(s) of this rank "
            f"need {needed} bytes") in lines[0]
    assert "exitcode  : 2" in result.stderr  # a user error: exit_on_user_error's code, no traceback
    assert "megadpp/transport/" not in result.stderr  # no stack through the transport (torchrun prints its own)


def test_missing_compiled_parts_are_named_as_missing(tmp_path):
    """A checkout whose extension was never built: the import says which part is missing (not an import
    cycle, as a `from package import module` of a missing module reads), and using it is one line that
    says how to build it."""
    copy = tmp_path / "checkout"
    shutil.copytree(REPO / "megadpp", copy / "megadpp", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(REPO / "megatron", copy / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    probe = ("from megadpp.transport import cuda_ipc_transport, shared_memory_transport, TransportSetupError\n"
             "for make in (shared_memory_transport, cuda_ipc_transport):\n"
             "    try:\n        make(0, [])\n    except TransportSetupError as error:\n        print(error)\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=copy, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(copy)})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == ("megadpp transport: CUDA IPC part not built (it is built only where CUDA's compiler is "
                        "found at build time); shared memory and torch.distributed transports only"), lines
    assert lines[1].startswith("megadpp transport: the shared-memory part of the C++ extension is not built; "
                               "build it in the repository with `pip install --no-build-isolation -e .`"), lines
    assert lines[2].startswith("megadpp transport: the CUDA IPC part, which moves DPP's tensors between the GPUs of "
                               "a node, is not built (it is built only where CUDA's compiler is found"), lines
    assert "on a machine with CUDA's compiler (nvcc)" in lines[2], lines
    assert "circular import" not in result.stdout + result.stderr
