"""Training across several machines: two torchrun agents as two nodes of one job (--nnodes 2, a c10d rendezvous
on 127.0.0.1) of two processes each train TP2 x PP2 with --save, --trace and --tensorboard-dir; the losses are a
one-node run's, no file is written by two processes (two nodes on one machine share its file system, as nodes
share a cluster's), the checkpoint resumes on one node at another layout, and the traces of both nodes merge.

strace logs each agent's writes (its workers' and their threads'), C++ ones (gloo, torch.save) included."""

import os
import shutil
import subprocess
import sys

import pytest
from helpers.launch import REPO, TINY_GPT, assert_succeeded, gpt_data_args, lm_losses, torchrun
from helpers.multi_node import run_nodes, written_paths

from megascan.aggregate import load_and_merge

ITERATIONS, SAVED_AT = 6, 3
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _train(data, nproc, *flags):
    result = torchrun(nproc, "pretrain_gpt.py", TINY_GPT + gpt_data_args(data) + ["--train-iters", ITERATIONS, *flags])
    assert_succeeded(result)
    return lm_losses(result.stdout)


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace, which tells the writers apart, is not installed")
def test_two_nodes_train_save_and_trace_once_each_and_resume_on_one_node_at_another_layout(gpt_data, tmp_path):
    one_node = _train(gpt_data, 4, *TP2_PP2)
    save, traces, tensorboard, logs = (tmp_path / name for name in ("ckpt", "trace", "tensorboard", "strace"))
    logs.mkdir()
    nodes = run_nodes("pretrain_gpt.py", TINY_GPT + gpt_data_args(gpt_data) + TP2_PP2 + [
        "--train-iters", ITERATIONS, "--exit-interval", SAVED_AT, "--save", save, "--trace", "--trace-dir", traces,
        "--trace-interval", SAVED_AT, "--tensorboard-dir", tensorboard], watch_dir=logs)
    for node in nodes:
        assert_succeeded(node)
    losses = lm_losses("".join(node.stdout for node in nodes))
    assert sorted(losses) == list(range(1, SAVED_AT + 1))
    for iteration in losses:
        assert losses[iteration] == pytest.approx(one_node[iteration], rel=1e-5), (iteration, losses, one_node)

    # Written once: no path has two writers (processes or threads), on one node or on two.
    writers = [written_paths(node.write_log, tmp_path) for node in nodes]
    both = sorted(set(writers[0]) & set(writers[1]))
    assert both == [], f"written by both nodes: {both}"
    twice = {path: pids for node in writers for path, pids in node.items() if len(pids) > 1}
    assert twice == {}, f"written by more than one process: {twice}"
    # ... and the watch saw each node's share: two ranks' traces and checkpoint shards each; one TensorBoard file.
    for node in writers:
        names = [os.path.relpath(path, tmp_path) for path in node]
        assert len([name for name in names if name.startswith("trace/")]) == 2, names
        assert {name.split("/")[-1][:3] for name in names if name.endswith(".distcp")} in ({"__0", "__1"},
                                                                                            {"__2", "__3"}), names
    written = {os.path.relpath(path, tmp_path) for node in writers for path in node}
    assert {f"trace/{name}" for name in os.listdir(traces)} <= written
    assert [name for name in written if name.startswith("tensorboard/")] == [
        f"tensorboard/{name}" for name in os.listdir(tensorboard)]

    resumed = _train(gpt_data, 2, "--pipeline-model-parallel-size", "2", "--load", save)
    assert sorted(resumed) == list(range(SAVED_AT + 1, ITERATIONS + 1))
    for iteration in resumed:
        assert resumed[iteration] == pytest.approx(one_node[iteration], rel=1e-3), (iteration, resumed, one_node)

    merged = load_and_merge(str(traces))
    assert merged.problems == [] and sorted(merged.ranks) == [0, 1, 2, 3]
    report = subprocess.run([sys.executable, str(REPO / "tools/aggregate.py"), "-b", str(traces), "-d"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    assert (traces / "benchmark.json").stat().st_size > 0
