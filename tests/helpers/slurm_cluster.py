"""A Slurm cluster of this one machine for a test: slurmctld and slurmd (Debian's slurm-wlm) on 127.0.0.1, their
configuration, state, spool and logs in the test's directory, on free ports, without munge (auth/none: nothing
leaves the machine) or cgroups (processes tracked by /proc). Started and stopped by the test: no daemon outlives it.
"""

import contextlib
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from helpers.apt_tools import install_missing, last_line
from megatron.training.ports import free_port

TOOLS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client"}  # command -> Debian package
START_TIMEOUT_S = 30


def slurm_conf(directory: Path, node_line: str) -> str:
    """slurm.conf for one node; ``node_line``: what `slurmd -C` detects here (NodeName=... CPUs=...)."""
    host = node_line.split()[0].split("=", 1)[1]
    return "\n".join([
        "ClusterName=megatronapp-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "AuthType=auth/none", "CredType=cred/none",  # no munge key: both daemons trust this machine
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={directory / 'state'}", f"SlurmdSpoolDir={directory / 'spool'}",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}", f"SlurmdPidFile={directory / 'slurmd.pid'}",
        f"SlurmctldLogFile={directory / 'slurmctld.log'}", f"SlurmdLogFile={directory / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",  # no cgroups
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2",
        f"{node_line} NodeAddr=127.0.0.1 State=UNKNOWN",
        f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n"


def _node_state(env: dict[str, str]) -> str:
    result = subprocess.run(["sinfo", "--noheader", "--format", "%T"], capture_output=True, text=True, env=env,
                            check=False)
    return result.stdout.strip() if result.returncode == 0 else ""


def _stop(daemon: subprocess.Popen) -> None:
    daemon.terminate()
    try:
        daemon.wait(timeout=10)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


@contextlib.contextmanager
def slurm_cluster(directory: Path):
    """Start the cluster and yield what its commands need in their environment ({"SLURM_CONF": ...}); stopped on
    leaving. Skips the test, naming the reason, where the tools cannot be had or the daemons do not come up."""
    install_missing(TOOLS, "Slurm test")
    detected = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=False)
    node_line = next((line for line in detected.stdout.splitlines() if line.startswith("NodeName=")), None)
    if node_line is None:
        pytest.skip(f"Slurm test: `slurmd -C` does not describe this machine: {last_line(detected)}")
    for sub in ("state", "spool"):
        (directory / sub).mkdir()
    conf = directory / "slurm.conf"
    conf.write_text(slurm_conf(directory, node_line))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = []
    try:
        for daemon in ("slurmctld", "slurmd"):  # -D: in the foreground, as this test's own child
            daemons.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + START_TIMEOUT_S
        while _node_state(env) not in ("idle", "mixed", "allocated"):
            exited = [d.args[0] for d in daemons if d.poll() is not None]
            if exited or time.monotonic() > deadline:
                why = f"{', '.join(exited)} exited" if exited else f"no idle node after {START_TIMEOUT_S} s"
                logs = " | ".join(_last_log_line(directory / f"{name}.log") for name in ("slurmctld", "slurmd"))
                pytest.skip(f"Slurm test: the one-machine cluster did not start ({why}): {logs}")
            time.sleep(0.2)
        yield {"SLURM_CONF": str(conf)}
    finally:
        for daemon in reversed(daemons):
            _stop(daemon)


def _last_log_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return f"{path.name}: {lines[-1] if lines else 'empty'}"


def submitted_job_id(sbatch_output: str) -> str:
    """The job id of `sbatch`'s 'Submitted batch job N'."""
    match = re.search(r"Submitted batch job (\d+)", sbatch_output)
    assert match, sbatch_output
    return match.group(1)


