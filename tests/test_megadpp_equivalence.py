"""MegaDPP computes what megatron-core's schedules compute: every iteration's losses and the weights after
10 iterations equal those of 1F1B / interleaved 1F1B, for GPT and BERT, at PP4, PP2 x TP2 with sequence
parallelism and a virtual pipeline, PP2 x DP2 with the distributed optimizer (overlapped reduce and gather)
and a virtual pipeline, and BERT at PP2; both policies, and an activation cap of 1 that forces orders
1F1B never runs. At PP4 stage 1's link is also slowed (--dpp-delay-link), for the static schedule too.
Every DPP transfer arrives with a random delay (--dpp-jitter-ms, a different seed per launch), so the runs
also check that no order of arrivals deadlocks the schedule.

One torchrun launch per layout runs all its schedules from the same start (tests/helpers/dpp_equivalence_entry.py).
"""

import json
import re

import pytest
from helpers.launch import REPO, TINY_GPT, assert_succeeded, gpt_data_args, torchrun
from torch.distributed.pipelining.schedules import _Action, _validate_schedule

ITERATIONS = 10
JITTER = ["--use-dpp", "--dpp-jitter-ms", "3"]

# name: (processes, entry, schedules, layout flags)
LAUNCHES = {
    "gpt_pp4": (4, "pretrain_gpt", "depth-first,breadth-first,depth-first:1",  # and a slow link, for all of them
                ["--pipeline-model-parallel-size", "4", "--seed", "11", "--dpp-delay-link", "1", "--dpp-delay-ms", "5",
                 "--dpp-delay-probability", "0.5"]),
    "gpt_pp2_tp2_sequence_parallel_virtual": (
        4, "pretrain_gpt", "depth-first,breadth-first",
        ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--num-layers-per-virtual-pipeline-stage", "1", "--seed", "12"]),
    "gpt_pp2_dp2_distributed_optimizer_virtual": (
        4, "pretrain_gpt", "depth-first,breadth-first:1",
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
         "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--seed", "13"]),
    "bert_pp2": (2, "pretrain_bert", "depth-first,breadth-first",
                 ["--pipeline-model-parallel-size", "2", "--seed", "14"]),
}


def _data_flags(entry, gpt_data, bert_data):
    if entry == "pretrain_gpt":
        return gpt_data_args(gpt_data)
    return ["--data-path", bert_data, "--tokenizer-type", "BertWordPieceLowerCase",
            "--vocab-file", REPO / "datasets/bert/vocab.txt"]


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_dpp_matches_static_schedule(launch, gpt_data, bert_data, tmp_path):
    nproc, entry, schedules, layout = LAUNCHES[launch]
    result = torchrun(nproc, "tests/helpers/dpp_equivalence_entry.py",
                      ["--entry", entry, "--schedules", schedules, "--iterations", ITERATIONS,
                       "--schedule-log-prefix", tmp_path / "log"]
                      + TINY_GPT + _data_flags(entry, gpt_data, bert_data)
                      + ["--train-iters", ITERATIONS] + JITTER + layout, timeout=900)
    assert_succeeded(result)
    lines = re.findall(r"DPP-EQUIVALENCE .*? (?:OK|MISMATCH)", result.stdout)
    specs = schedules.split(",")
    assert len(lines) == nproc * len(specs), result.stdout[-3000:]
    assert all(line.endswith(" OK") for line in lines), "\n".join(lines)
    assert any(f"losses={ITERATIONS}" in line or f"losses={2 * ITERATIONS}" in line for line in lines), lines
    for index, spec in enumerate(specs):
        _check_logged_schedule(json.loads((tmp_path / f"log-{index}.json").read_text()), spec)


def _check_logged_schedule(log, spec):
    """Every iteration's logged orders are valid torch.distributed.pipelining schedules; a cap of 1 ran
    an order that 1F1B does not (so the equality above is not the same order twice)."""
    assert len(log["iterations"]) == ITERATIONS
    pipelines = {}
    for rank, coords in log["ranks"].items():
        pipelines.setdefault((coords["tp"], coords["dp"]), {})[coords["pp"]] = rank
    for iteration in log["iterations"]:
        for ranks in pipelines.values():
            actions = {pp: [_Action.from_str(a) for a in iteration["actions"][rank]] for pp, rank in ranks.items()}
            _validate_schedule(actions, log["pp_size"], log["num_stages"], iteration["num_microbatches"])
    if spec.endswith(":1"):
        first_stage = log["iterations"][0]["actions"][pipelines[(0, 0)][0]]
        assert "B" in first_stage[1] or "B" in first_stage[2], first_stage  # 1F1B would run forwards first
