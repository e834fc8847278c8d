"""The local layers' FP8 linears on CPU (one process, gloo): --fp8-format swaps exactly the transformer layers' four
linears, their GEMMs run in FP8 (operands' types by format, scales by recipe) and the embedding and output layer's do
not, losses and gradients follow bf16's, and the checkpoint is the bf16 model's: same entries, and a model saved by an
FP8 run loads into a bf16 one and back. tests/helpers/fp8_model_checks.py measures; this file judges."""

import json
import subprocess
import sys

import pytest
from helpers.launch import REPO, child_env

from megatron.training.ports import free_port

LAYERS = 4  # TINY_MODEL_FLAGS
COMBINATIONS = [f"{fp8_format} {fp8_recipe}" for fp8_format in ("e4m3", "hybrid")
                for fp8_recipe in ("tensorwise", "rowwise")]
E4M3, E5M2 = "torch.float8_e4m3fn", "torch.float8_e5m2"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    result = subprocess.run([sys.executable, str(REPO / "tests/helpers/fp8_model_checks.py"),
                             str(tmp_path_factory.mktemp("fp8_checkpoints"))], capture_output=True, text=True,
                            cwd=REPO, env=child_env({"MASTER_PORT": str(free_port())}), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_only_the_transformer_layers_linears_are_swapped(report, combination):
    classes = report["fp8"][combination]["classes"]
    expected = {"embedding.word_embeddings": "VocabParallelEmbedding", "output_layer": "ColumnParallelLinear"}
    for layer in range(LAYERS):
        attention, mlp = f"decoder.layers.{layer}.self_attention", f"decoder.layers.{layer}.mlp"
        expected |= {f"{attention}.linear_qkv": "Float8ColumnParallelLinear",
                     f"{attention}.linear_proj": "Float8RowParallelLinear",
                     f"{mlp}.linear_fc1": "Float8ColumnParallelLinear", f"{mlp}.linear_fc2": "Float8RowParallelLinear"}
    assert classes == expected


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_each_layer_gemm_runs_in_fp8_and_the_output_layers_does_not(report, combination):
    measured = report["fp8"][combination]
    # Four linears a layer: one FP8 GEMM each forward, two backward (input and weight gradients); none elsewhere.
    assert len(measured["forward_gemms"]) == 4 * LAYERS
    assert len(measured["backward_gemms"]) == 2 * 4 * LAYERS


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_the_format_picks_the_gradients_fp8_type_and_the_recipe_the_scales(report, combination):
    fp8_format, fp8_recipe = combination.split()
    measured = report["fp8"][combination]
    rowwise = fp8_recipe == "rowwise"
    assert {tuple(gemm) for gemm in measured["forward_gemms"]} == {(E4M3, E4M3, rowwise)}
    # Backward, the output gradient is the first operand (torchao scales a rowwise one after a per-tensor GEMM).
    gradient = E5M2 if fp8_format == "hybrid" else E4M3
    assert {tuple(gemm) for gemm in measured["backward_gemms"]} == {(gradient, E4M3, False)}


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_fp8_losses_and_gradients_follow_bf16s_from_the_same_weights(report, combination):
    measured = report["fp8"][combination]
    assert measured["loss"] == pytest.approx(report["bf16"]["loss"], rel=1e-2)
    assert len(measured["grads"]) == 4 * LAYERS
    for name, (cosine, dtype) in measured["grads"].items():
        assert cosine > 0.99 and dtype == "torch.bfloat16", (name, cosine, dtype)


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_the_fp8_model_holds_the_bf16_models_checkpoint_entries(report, combination):
    measured, bf16 = report["fp8"][combination], report["bf16"]
    assert measured["state_dict"] == bf16["state_dict"]  # names, shapes, dtypes
    assert measured["sharded_keys"] == bf16["sharded_keys"]


@pytest.mark.parametrize("direction", ["fp8_to_bf16", "bf16_to_fp8"])
def test_a_checkpoint_moves_between_fp8_and_bf16_models(report, direction):
    moved = report["round_trip"][direction]
    assert moved["before"] > 0.01 and moved["after"] == 0  # different weights, then the saved ones exactly
    assert moved["loss_loaded"] == pytest.approx(moved["loss_saved"], rel=1e-2)  # the other precision's loss
