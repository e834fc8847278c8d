"""MegaDPP and MegaFBD on two nodes (two torchrun agents of two processes each, a c10d rendezvous on 127.0.0.1):
DPP's pipeline neighbours on the same node exchange over shared memory and those on the other node over
torch.distributed; FBD's backward and forward instances land on different nodes. Both compute a one-process
run's losses, write each file once (--save, --trace, --dpp-log-schedule) and leave traces that merge. DPP on GPUs
across nodes is refused at launch in one line."""


import pytest
from helpers.apt_tools import install_missing
from helpers.launch import TINY_GPT, assert_succeeded, gpt_data_args, lm_losses, torchrun
from helpers.multi_node import STRACE, node_command, run_nodes, writes_by_node

from megadpp.arguments import add_arguments, validate_args
from megadpp.nodes import launch_spans_nodes
from megascan.aggregate import load_and_merge
from megatron.training.arguments import parse_args
from megatron.training.errors import ArgumentError

ITERATIONS = 4
RELATIVE_TOLERANCE = 1e-3  # other layouts reassociate float sums (tests/test_parallel_layouts.py)


@pytest.fixture(scope="module")
def one_process(gpt_data):
    result = torchrun(1, "pretrain_gpt.py", TINY_GPT + gpt_data_args(gpt_data) + ["--train-iters", ITERATIONS])
    assert_succeeded(result)
    return lm_losses(result.stdout)


def _two_nodes(data, root, *flags):
    """A traced two-node job saving into ``root``, under strace; its nodes and merged output."""
    install_missing(STRACE, "two-node test")
    (root / "strace").mkdir()
    nodes = run_nodes(node_command(2, 2, "pretrain_gpt.py", TINY_GPT + gpt_data_args(data) + [
        "--train-iters", ITERATIONS, "--save", root / "ckpt", "--trace", "--trace-dir", root / "trace",
        "--trace-interval", 2, *flags]), watch_dir=root / "strace")
    for node in nodes:
        assert_succeeded(node)
    return nodes, "".join(node.stdout for node in nodes)


def _assert_losses_equal(losses, reference):
    assert sorted(losses) == list(range(1, ITERATIONS + 1)), losses
    for iteration, loss in losses.items():
        assert loss == pytest.approx(reference[iteration], rel=RELATIVE_TOLERANCE), (iteration, losses, reference)


def test_dpp_across_two_nodes_routes_within_and_between_them_and_computes_the_same_losses(
        gpt_data, one_process, tmp_path):
    nodes, output = _two_nodes(gpt_data, tmp_path, "--pipeline-model-parallel-size", 4, "--use-dpp",
                               "--dpp-log-schedule", tmp_path / "schedule.json")
    assert "over shared memory within a node, torch.distributed across nodes" in output, output[-3000:]
    _assert_losses_equal(lm_losses(output), one_process)
    written = writes_by_node(nodes, tmp_path)
    schedule_log = [path for node in written for path in node if "schedule.json" in path]
    assert len(schedule_log) == 2 and str(tmp_path / "schedule.json") in schedule_log, written  # rank 0: temp, rename
    merged = load_and_merge(str(tmp_path / "trace"))
    assert merged.problems == [] and sorted(merged.ranks) == [0, 1, 2, 3]
    p2p = [instance for instance in merged.instances if instance.kind == "p2p"]
    assert p2p and all(not instance.missing and len(instance.records) == 2 for instance in p2p)


def test_fbd_with_backward_and_forward_instances_on_two_nodes_computes_the_same_losses(
        gpt_data, one_process, tmp_path):
    nodes, output = _two_nodes(gpt_data, tmp_path, "--forward-backward-disaggregating",
                               "--pipeline-model-parallel-size", 2, "--recompute-granularity", "full",
                               "--recompute-method", "uniform")
    _assert_losses_equal(lm_losses(output), one_process)
    assert output.count("megafbd: forward instance") == 2, output[-3000:]
    writes_by_node(nodes, tmp_path)
    merged = load_and_merge(str(tmp_path / "trace"))
    assert merged.problems == [] and sorted(merged.ranks) == [0, 1, 2, 3]


def test_dpp_on_gpus_of_several_nodes_is_refused_in_one_line(monkeypatch):
    flags = ["--mock-data", "--vocab-size", "1000", "--train-iters", "2", "--use-dpp",
             "--pipeline-model-parallel-size", "2", "--device", "cuda"]
    args = parse_args(TINY_GPT + flags, "pretrain_gpt.py", add_arguments)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError, match=r"^--use-dpp on GPUs runs within one node: this launch spans several "):
        validate_args(args)
    assert launch_spans_nodes(None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one node of four: allowed
    assert not launch_spans_nodes(None)
