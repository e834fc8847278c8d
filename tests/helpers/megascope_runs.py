"""The tiny-GPT runs of megascope_run.py that the capture and perturbation tests share: each layout runs
once per test session (torchrun, gloo) and both test files read its saved results."""

import functools
import os

import torch

from helpers.launch import assert_succeeded, torchrun
from helpers.megascope_model import TINY_MODEL_FLAGS

GQA = ["--group-query-attention", "--num-query-groups", "2"]
LAYOUTS = {
    "single": (1, []),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp2_pp2_sequence_parallel": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                      "--sequence-parallel"]),
    "gqa_unfused": (1, GQA + ["--attention-backend", "unfused"]),
    "gqa_tp2": (2, GQA + ["--tensor-model-parallel-size", "2"]),
}
# layout -> the one-rank layout of the same model it must reproduce
REFERENCE = {"pp2": "single", "tp2_pp2_sequence_parallel": "single", "gqa_tp2": "gqa_unfused"}


def runs_root(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "megascope_runs")


@functools.cache
def saved(layout, root):
    nproc, flags = LAYOUTS[layout]
    out = f"{root}/{layout}"
    os.makedirs(out, exist_ok=True)
    result = torchrun(nproc, "tests/helpers/megascope_run.py", [out, *TINY_MODEL_FLAGS, *flags])
    assert_succeeded(result)
    return torch.load(f"{out}/saved.pt", weights_only=False)
