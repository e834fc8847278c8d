"""lm-evaluation-harness (pinned) with its ``local-completions`` model against the server's OpenAI-compatible
completions, offline, on the multiple-choice task of tests/data/lm_eval: a converted Llama 3 served at TP2 from
--load alone scores each choice as transformers does on the original model (tests/helpers/
multiple_choice_reference.py), so the accuracy is the same."""

import glob
import json
import subprocess
import sys

import pytest
from helpers.generation_server import GenerationServer
from helpers.launch import REPO, child_env
from helpers.multiple_choice_reference import score
from test_hf_conversion import LLAMA3, _convert, _hf_model

TASK = REPO / "tests/data/lm_eval"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def test_lm_eval_accuracy_equals_the_reference(tmp_path):
    _hf_model(tmp_path / "hf", LLAMA3, seed=1)
    _convert(tmp_path / "hf", tmp_path / "megatron")
    server = GenerationServer(2, ["--load", str(tmp_path / "megatron"), "--use-checkpoint-args", "--device", "cpu",
                                  "--tensor-model-parallel-size", "2"])
    try:
        model_args = (f"model=megatron,base_url={server.rest}/v1/completions,tokenizer={tmp_path / 'megatron/hf'},"
                      "tokenizer_backend=huggingface,max_length=256")
        result = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
             "--tasks", "tiny_mc", "--include_path", str(TASK), "--output_path", str(tmp_path / "out"),
             "--log_samples"], cwd=REPO, capture_output=True, text=True, timeout=600,
            env=child_env({**OFFLINE, "HF_HOME": str(tmp_path / "hf_home")}))
    finally:
        server.stop()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(open(glob.glob(str(tmp_path / "out/*/results_*.json"))[0]).read())["results"]["tiny_mc"]
    samples = [json.loads(line) for line in open(glob.glob(str(tmp_path / "out/*/samples_tiny_mc_*.jsonl"))[0])]
    accuracy, reference = score(tmp_path / "hf", TASK / "tiny_mc.jsonl")
    assert results["sample_len"] == len(reference) == 24
    assert results["acc,none"] == accuracy
    for sample in samples:
        served = [float(value) for value, _ in sample["filtered_resps"]]
        assert served == pytest.approx(reference[sample["doc_id"]], abs=1e-3), sample["doc"]
