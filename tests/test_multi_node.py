"""Training across several machines: README's "Several machines" command, two torchrun agents as two nodes of one
job (--nnodes 2, a c10d rendezvous on 127.0.0.1) of two processes each training TP2 x PP2, here with --save, --trace
and --tensorboard-dir: the losses are a one-node run's, no file is written by two processes (two nodes on one
machine share its file system, as nodes share a cluster's), the checkpoint resumes on one node at another layout,
and the traces of both nodes merge.

strace logs each agent's writes (its workers' and their threads'), C++ ones (gloo, torch.save) included."""

import os
import subprocess
import sys

import pytest
from helpers.apt_tools import install_missing
from helpers.launch import REPO, assert_succeeded, lm_losses, torchrun
from helpers.multi_node import STRACE, run_nodes, writes_by_node
from helpers.readme_commands import as_launched, readme_commands

from megascan.aggregate import load_and_merge
from megatron.training.ports import free_port

SAVED_AT = 3
# Dropout's masks depend on the tensor-parallel rank: off, so that a resume at another layout has the same losses.
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _readme_agent():
    """The torchrun command of README's "Several machines" loop (what each node runs), and its training flags."""
    loop = readme_commands("Several machines")[0]
    agent = loop[loop.index("torchrun"):loop.index("&")]
    return agent, agent[agent.index("pretrain_gpt.py") + 1:]


def _train(nproc, flags):
    result = torchrun(nproc, "pretrain_gpt.py", flags + NO_DROPOUT)
    assert_succeeded(result)
    return lm_losses(result.stdout)


def test_two_nodes_train_save_and_trace_once_each_and_resume_on_one_node_at_another_layout(tmp_path):
    install_missing(STRACE, "two-node test")
    agent, flags = _readme_agent()
    iterations = int(flags[flags.index("--train-iters") + 1])
    one_node = _train(4, flags)
    save, traces, tensorboard, logs = (tmp_path / name for name in ("ckpt", "trace", "tensorboard", "strace"))
    logs.mkdir()
    nodes = run_nodes(as_launched(agent, {"--rdzv-endpoint": f"127.0.0.1:{free_port()}"}) + NO_DROPOUT + [
        "--exit-interval", SAVED_AT, "--save", save, "--trace", "--trace-dir", traces, "--trace-interval", SAVED_AT,
        "--tensorboard-dir", tensorboard], watch_dir=logs)
    for node in nodes:
        assert_succeeded(node)
    losses = lm_losses("".join(node.stdout for node in nodes))
    assert sorted(losses) == list(range(1, SAVED_AT + 1))
    for iteration in losses:
        assert losses[iteration] == pytest.approx(one_node[iteration], rel=1e-5), (iteration, losses, one_node)

    writers = writes_by_node(nodes, tmp_path)  # no path written by two processes, on one node or on two
    # ... and the watch saw each node's share: two ranks' traces and checkpoint shards each; one TensorBoard file.
    for node in writers:
        names = [os.path.relpath(path, tmp_path) for path in node]
        assert len([name for name in names if name.startswith("trace/")]) == 2, names
        assert {name.split("/")[-1][:3] for name in names if name.endswith(".distcp")} in ({"__0", "__1"},
                                                                                            {"__2", "__3"}), names
    written = {os.path.relpath(path, tmp_path) for node in writers for path in node}
    assert {f"trace/{name}" for name in os.listdir(traces)} | {"ckpt/latest_checkpointed_iteration.txt"} <= written
    assert [name for name in written if name.startswith("tensorboard/")] == [
        f"tensorboard/{name}" for name in os.listdir(tensorboard)]

    layout = flags.index("--tensor-model-parallel-size")
    resumed = _train(2, flags[:layout] + ["--tensor-model-parallel-size", "1"] + flags[layout + 2:] + ["--load", save])
    assert sorted(resumed) == list(range(SAVED_AT + 1, iterations + 1))
    for iteration in resumed:
        assert resumed[iteration] == pytest.approx(one_node[iteration], rel=1e-3), (iteration, resumed, one_node)

    merged = load_and_merge(str(traces))
    assert merged.problems == [] and sorted(merged.ranks) == [0, 1, 2, 3]
    report = subprocess.run([sys.executable, str(REPO / "tools/aggregate.py"), "-b", str(traces), "-d"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    assert (traces / "benchmark.json").stat().st_size > 0
