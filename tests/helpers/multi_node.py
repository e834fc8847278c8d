"""A job of several nodes on this one machine: one torchrun agent per node (--nnodes), meeting at a
c10d rendezvous on 127.0.0.1, as a cluster's nodes meet at their first node's address; and, with strace, which
process of which node wrote each file, so a test can tell whether two nodes wrote one path."""

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from helpers.launch import REPO, child_env, kill_process_tree
from megatron.training.ports import free_port

STRACE = {"strace": "strace"}  # command -> Debian package: what tells the writers apart
# The system calls that create or replace a file (an open for reading only is not a write).
WRITE_CALLS = "open,openat,creat,rename,renameat,renameat2,truncate"
_WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


def node_command(nnodes, nproc, script, args):
    """The torchrun command of each node of an ``nnodes``-node job of ``nproc`` processes per node, on a free port of
    127.0.0.1. No --node-rank: the c10d rendezvous numbers the nodes in the order they join (and ignores it)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "multi-node-test",
            str(REPO / script), *map(str, args)]


@dataclass
class NodeRun:
    """One node's agent: its exit status and output, and (when watched) the strace log of its processes. Which
    ranks a node got is the rendezvous's choice: the last rank's log lines (the losses) may be on either."""

    returncode: int
    stdout: str
    stderr: str
    write_log: Path | None


def run_nodes(command, nnodes=2, env=None, watch_dir=None, timeout=300):
    """Start ``command`` (a node's torchrun command) as the ``nnodes`` agents of one job at once and wait for all; a
    NodeRun each, in the order started. ``watch_dir``: run each agent under strace, which logs the writes of the
    agent and its workers there."""
    agents, logs = [], []
    try:
        for node in range(nnodes):
            log, watched = None, list(map(str, command))
            if watch_dir is not None:
                log = Path(watch_dir) / f"node{node}.strace"
                watched = ["strace", "-f", "-qq", "--seccomp-bpf", "-e", f"trace={WRITE_CALLS}", "-e",
                           "status=successful", "-s", "4096", "-o", str(log), *watched]
            logs.append(log)
            agents.append(subprocess.Popen(watched, cwd=REPO, env=child_env(env), stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True))
        outputs = [agent.communicate(timeout=timeout) for agent in agents]
    finally:
        for agent in agents:
            if agent.returncode is None:
                kill_process_tree(agent.pid)
                agent.wait()
    return [NodeRun(agent.returncode, out, err, log) for agent, (out, err), log in zip(agents, outputs, logs)]


def written_paths(log, under):
    """{path: {pid, ...}}: the files under ``under`` that the processes of an strace log created, opened for
    writing, truncated or renamed into place (a rename writes its destination)."""
    root = str(Path(under).resolve())
    writers = {}
    for line in Path(log).read_text().splitlines():
        pid, call = line.split(maxsplit=1)
        name = call.split("(", 1)[0]
        paths = _QUOTED.findall(call)
        if not paths:
            continue
        if name.startswith("rename"):
            written = paths[-1]
        elif name == "truncate" or name == "creat" or any(flag in call for flag in _WRITE_FLAGS):
            written = paths[0]
        else:
            continue
        if written.startswith(root + "/"):
            writers.setdefault(written, set()).add(int(pid))
    return writers


def writes_by_node(nodes, under):
    """The files under ``under`` each node's processes wrote ({path: pids} per node), checked to be written once:
    no path by two nodes, none by two processes (or threads) of one node."""
    writers = [written_paths(node.write_log, under) for node in nodes]
    for index, node in enumerate(writers):
        twice = {path: pids for path, pids in node.items() if len(pids) > 1}
        assert twice == {}, f"written by more than one process of node {index}: {twice}"
        for other in writers[index + 1:]:
            both = sorted(set(node) & set(other))
            assert both == [], f"written by two nodes: {both}"
    return writers
