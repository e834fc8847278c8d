"""The Dockerfile builds and the quickstart runs in its container (podman, CPU).

The image is built on a debootstrapped Debian base instead of NVIDIA's (which CI cannot pull), with
the CPU torch this machine's pip sources provide; the quickstart then trains with the output volume
as its only writable place (read-only root filesystem): its checkpoint and the merged trace must
appear in the volume. Skips with one line where podman cannot run (podman_env says why).
"""

import json
import re
import subprocess

import pytest
from helpers.launch import REPO
from helpers.podman_env import (
    ensure_base_image,
    install_tools,
    pip_sources_for_build,
    podman_environment,
)

IMAGE = "localhost/megatronapp-ci/megatronapp:test"
TRAIN_ITERS = 10  # the quickstart at 10 iterations: its warm-up must end within the run
BUILT_BY_TEST = "megatronapp-ci-test-image"


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp("podman")
    install_tools()
    env = podman_environment(work_dir)
    base = ensure_base_image(env, work_dir)
    build = subprocess.run(
        ["podman", "build", "--network", "host", *pip_sources_for_build(work_dir), "--label", BUILT_BY_TEST,
         "--build-arg", f"BASE_IMAGE={base}", "-t", IMAGE, "-f", str(REPO / "Dockerfile"), str(REPO)],
        check=False, env=env, capture_output=True, text=True)
    assert build.returncode == 0, f"podman build failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}"
    # The image this test built before a code change lost its tag: remove it (and only images of this test).
    subprocess.run(["podman", "image", "prune", "-f", "--filter", f"label={BUILT_BY_TEST}"],
                   check=False, env=env, capture_output=True)
    return env


def test_quickstart_in_the_container_writes_checkpoint_and_merged_trace_to_the_volume(image, tmp_path):
    volume = tmp_path / "outputs"
    volume.mkdir()
    volume.chmod(0o777)  # the image runs as a non-root user
    script = ("python3 -c 'import torch; print(\"torch CUDA build:\", torch.version.cuda)' && "
              "bash docker/DockerUsage_Quickstart.sh /outputs")
    run = subprocess.run(
        ["podman", "run", "--rm", "--read-only", "--network", "none", "--shm-size", "1g",
         "-e", f"TRAIN_ITERS={TRAIN_ITERS}", "-v", f"{volume}:/outputs", IMAGE, "bash", "-c", script],
        check=False, env=image, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"quickstart in the container failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    # The CPU wheel of this machine's sources, not a CUDA build downloaded from PyPI.
    assert "torch CUDA build: None" in run.stdout

    checkpoint = volume / "checkpoints"
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)
    assert any((checkpoint / f"iter_{TRAIN_ITERS:07d}").iterdir())
    merged = list(volume.glob("trace/*/benchmark.json"))
    assert len(merged) == 1, f"expected one merged trace in the volume, found {merged}"
    events = json.loads(merged[0].read_text())["traceEvents"]
    ranks = {re.search(r"\(rank (\d+)\)", e["args"]["name"]).group(1) for e in events if e["name"] == "thread_name"}
    assert ranks == {"0", "1", "2", "3"}  # TP2 x PP2 on 4 CPU processes, merged into one timeline
    assert any(e["ph"] == "X" and e["name"] == "mlp-forward" for e in events)


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "docker").glob("DockerUsage_*.sh")))
def test_run_scripts_refuse_a_missing_or_unwritable_output_dir_in_one_line(script, tmp_path):
    for arguments, problem in (([], "missing OUTPUT_DIR"), (["/proc/outputs"], "is not writable")):
        result = subprocess.run(["bash", str(REPO / "docker" / script), *arguments],
                                check=False, capture_output=True, text=True)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.count("\n") == 1 and problem in result.stderr, result.stderr
