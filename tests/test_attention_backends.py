"""--attention-backend: PyTorch's scaled_dot_product_attention (the default, and its flash kernel)
trains to megatron-core's unfused attention losses with dropout off, for GPT at TP1 and TP2 x PP2,
with grouped-query attention at TP2, and for BERT with its padding mask; attention dropout acts."""

import functools
import re

import pytest
from helpers.launch import REPO, TINY_GPT, assert_succeeded, gpt_data_args, lm_losses, torchrun

ITERATIONS = 4
RELATIVE_TOLERANCE = 1e-4  # fp32 on CPU: only the order of the softmax's sums differs
TP2_PP2 = (4, ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"))
LAYOUTS = {"single": (1, ()), "tp2_pp2": TP2_PP2,
           "tp2_gqa": (2, ("--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "2"))}


@functools.cache
def _gpt_losses(layout, backend, data_prefix, attention_dropout="0"):
    nproc, flags = LAYOUTS[layout]
    args = TINY_GPT + gpt_data_args(data_prefix) + ["--train-iters", ITERATIONS, "--attention-backend", backend,
                                                    "--attention-dropout", attention_dropout, *flags]
    result = torchrun(nproc, "pretrain_gpt.py", args)
    assert_succeeded(result)
    losses = lm_losses(result.stdout)
    assert sorted(losses) == list(range(1, ITERATIONS + 1)), result.stdout[-2000:]
    return losses


def _assert_same(losses, reference):
    for iteration in reference:
        assert losses[iteration] == pytest.approx(reference[iteration], rel=RELATIVE_TOLERANCE), (iteration, losses,
                                                                                                  reference)


@pytest.mark.parametrize("layout, backend", [("single", "flash"), ("tp2_pp2", "flash"), ("tp2_gqa", "auto")])
def test_sdpa_gives_the_unfused_losses(layout, backend, gpt_data):
    _assert_same(_gpt_losses(layout, backend, str(gpt_data)), _gpt_losses(layout, "unfused", str(gpt_data)))


def test_attention_dropout_acts_and_training_still_converges(gpt_data):
    without = _gpt_losses("single", "auto", str(gpt_data))
    with_dropout = _gpt_losses("single", "auto", str(gpt_data), attention_dropout="0.3")
    assert with_dropout[1] == pytest.approx(without[1], rel=0.05)
    assert with_dropout[ITERATIONS] != pytest.approx(without[ITERATIONS], rel=1e-4), "dropout changed nothing"
    assert with_dropout[ITERATIONS] < with_dropout[1]


def _bert_lm_losses(backend, data):
    args = TINY_GPT + ["--data-path", data, "--tokenizer-type", "BertWordPieceLowerCase",
                       "--vocab-file", REPO / "datasets/bert/vocab.txt", "--train-iters", ITERATIONS,
                       "--attention-backend", backend]
    result = torchrun(1, "pretrain_bert.py", args)
    assert_succeeded(result)
    found = re.findall(r"iteration\s+(\d+)/.*?\| lm loss: ([0-9.E+-]+)", result.stdout)
    assert len(found) == ITERATIONS, result.stdout[-2000:]
    return {int(i): float(loss) for i, loss in found}


def test_bert_padding_mask_gives_the_unfused_losses(bert_data):
    _assert_same(_bert_lm_losses("flash", bert_data), _bert_lm_losses("unfused", bert_data))
