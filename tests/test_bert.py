"""BERT (megatron-core BertModel and BERT dataset) trains at TP2 x PP2 with the single-rank losses."""

import re

import pytest
from helpers.launch import REPO, TINY_GPT, assert_succeeded, torchrun

ITERATIONS = 10


def _bert_losses(nproc, data, *flags):
    args = TINY_GPT + ["--data-path", data, "--tokenizer-type", "BertWordPieceLowerCase",
                       "--vocab-file", REPO / "datasets/bert/vocab.txt", "--train-iters", ITERATIONS, *flags]
    result = torchrun(nproc, "pretrain_bert.py", args)
    assert_succeeded(result)
    found = re.findall(r"iteration\s+(\d+)/.*?\| lm loss: ([0-9.E+-]+) \| sop loss: ([0-9.E+-]+)", result.stdout)
    assert len(found) == ITERATIONS, result.stdout[-2000:]
    return {int(i): (float(lm), float(sop)) for i, lm, sop in found}


def test_bert_tp2_pp2_trains_and_matches_single_rank(bert_data):
    single = _bert_losses(1, bert_data)
    parallel = _bert_losses(4, bert_data, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert parallel[ITERATIONS][0] < parallel[1][0] - 0.5, parallel
    for iteration in (1, 2, 3):
        assert parallel[iteration] == pytest.approx(single[iteration], rel=1e-3), (iteration, parallel, single)
