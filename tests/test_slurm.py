"""examples/slurm/train_gpt3_345m.sbatch under a one-machine Slurm (tests/helpers/slurm_cluster.py): Slurm's parser
accepts it (`sbatch --test-only`), and `sbatch --wait` runs it on CPU (a tiny model over the example's 345M flags,
two processes): the job trains to its last iteration and MegaScan's traces land in the job id's own directory."""

import os
import subprocess
import sys
from pathlib import Path

from helpers.launch import REPO, child_env
from helpers.slurm_cluster import slurm_cluster, submitted_job_id

from megatron.training.ports import free_port

SCRIPT = "examples/slurm/train_gpt3_345m.sbatch"
ITERATIONS = 3
TINY_ON_CPU = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "64", "--max-position-embeddings", "64", "--eval-iters", "0", "--log-interval", "1",
               "--trace-interval", str(ITERATIONS)]


def _sbatch(options, env, timeout=60):
    return subprocess.run(["sbatch", *options, SCRIPT, *TINY_ON_CPU], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_sbatch_example_runs_one_torchrun_per_node_and_traces_into_the_job_directory(tmp_path):
    cluster_dir, traces = tmp_path / "slurm", tmp_path / "traces"
    cluster_dir.mkdir()
    with slurm_cluster(cluster_dir) as slurm_env:
        env = child_env({**slurm_env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                         "GPUS_PER_NODE": "2", "MICRO_BATCH": "1", "GLOBAL_BATCH": "4",
                         "TRAIN_ITERS": str(ITERATIONS), "TRACE_ROOT": str(traces), "MASTER_PORT": str(free_port())})
        one_node = ["--nodes", "1"]  # this machine is the cluster's one node
        parsed = _sbatch(["--test-only", *one_node], env)
        assert parsed.returncode == 0 and "to start at" in parsed.stderr, parsed.stderr
        job = _sbatch(["--wait", *one_node, "--output", str(tmp_path / "job-%j.out")], env, timeout=240)
        job_id = submitted_job_id(job.stdout)
        log = (tmp_path / f"job-{job_id}.out").read_text()
        assert job.returncode == 0, log[-5000:]
    assert f"job {job_id}: 1 nodes" in log and f"traces in {traces}/{job_id}" in log, log[-3000:]
    assert f"iteration        {ITERATIONS}/       {ITERATIONS} |" in log, log[-3000:]
    assert len(list((traces / job_id).glob("benchmark-*.json"))) == 2
