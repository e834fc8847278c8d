"""MegaScope perturbations on a real megatron-core GPT under torchrun/gloo: seeded and reproducible,
the same perturbed values at TP2 (GQA), PP2 and TP2xPP2 (sequence parallel) as at one rank, storage noise
restored bit for bit, gradients through calculation/system noise equal a finite difference; bad
perturbations are ProtocolErrors naming the field."""

import pytest
import torch
from helpers.megascope_perturbation_phases import CONSTANT_FELT, CONSTANT_REMOVED
from helpers.megascope_runs import REFERENCE, runs_root, saved

from megascope.errors import ProtocolError
from megascope.perturbations import Perturbation, apply_noise, draw_noise


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return runs_root(tmp_path_factory)


def _run(layout, root):
    return saved(layout, root)["perturbation"]


def _values(records):
    return {(r.hook, r.layer, r.prompt_index): r.values for r in records}


def _assert_records_close(got, want, **tolerance):
    got, want = _values(got), _values(want)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=str(key), **tolerance)


def test_seeded_perturbations_act_repeat_exactly_and_restore_bit_for_bit(tmp_root):
    saved = _run("single", tmp_root)
    plain, perturbed = _values(saved["plain"]), _values(saved["perturbed"])
    assert all(not torch.allclose(perturbed[key], plain[key], atol=1e-3) for key in plain if key[0] == "logits")
    _assert_records_close(saved["perturbed_again"], saved["perturbed"], atol=0, rtol=0)
    assert saved["restored_exactly"] and saved["bitflips_restored_exactly"]
    _assert_records_close(saved["restored"], saved["plain"], atol=0, rtol=0)
    # each of the upper 16 bits of 4 x (128 x 64 + 128) fc1 values flips at 1 %: 1 - 0.99^16 = 15 % change
    assert 4400 < saved["bitflipped_weights"] < 5500


@pytest.mark.parametrize("layout, reference", list(REFERENCE.items()))
def test_same_seed_gives_the_same_perturbed_forward_at_every_layout(layout, reference, tmp_root):
    got, want = _run(layout, tmp_root), _run(reference, tmp_root)
    _assert_records_close(got["perturbed"], want["perturbed"], atol=1e-5, rtol=1e-4)
    assert got["restored_exactly"] and got["bitflips_restored_exactly"]


def test_gradients_flow_through_calculation_and_system_noise(tmp_root):
    analytic, finite_difference = _run("single", tmp_root)["gradient"]
    assert analytic == pytest.approx(finite_difference, rel=1e-2)
    assert analytic != 0


def test_a_constant_that_shifts_the_residual_stream_does_nothing_on_a_layernorm_model(tmp_root):
    """What docs/megascope.md and the page's note say: a constant on the residual stream, on what is added to it
    and on the weights that write it is removed by the next LayerNorm; elsewhere it changes the output."""
    effects = _run("single", tmp_root)["constant_effects"]
    removed = {key: change for key, change in effects.items() if change < 1e-4}
    assert sorted(removed) == sorted(CONSTANT_REMOVED), effects
    assert all(effects[key] > 1e-2 for key in CONSTANT_FELT), effects


def test_bit_flips_xor_the_16_bit_storage():
    p = Perturbation.from_json({"kind": "storage", "target": "ln1", "noise": "bitflip", "scale": 1.0})
    values = torch.tensor([1.0, -2.5], dtype=torch.bfloat16)
    flipped = apply_noise(values, p, draw_noise(p, [2], torch.bfloat16, "w"))
    assert torch.equal(flipped.view(torch.int16), ~values.view(torch.int16))  # every bit at rate 1
    full = torch.tensor([1.0], dtype=torch.float32)
    upper = apply_noise(full, p, draw_noise(p, [1], torch.float32, "w")).view(torch.int32)
    assert upper.item() == (full.view(torch.int32).item() ^ -65536)  # the upper 16 bits only


@pytest.mark.parametrize("obj, field", [
    ({"kind": "storage", "target": "mlp.out", "noise": "gaussian", "scale": 1}, "target"),
    ({"kind": "magic", "target": "resid_post", "noise": "gaussian", "scale": 1}, "kind"),
    ({"kind": "system", "target": "resid_post", "noise": "pink", "scale": 1}, "noise"),
    ({"kind": "system", "target": "resid_post", "noise": "bitflip", "scale": 2}, "scale"),
    ({"kind": "system", "target": "resid_post", "noise": "gaussian", "scale": "1"}, "scale"),
    ({"kind": "system", "target": "resid_post", "noise": "gaussian", "scale": 1, "seed": -1}, "seed"),
    ({"kind": "system", "target": "resid_post", "noise": "gaussian", "scale": 1, "layers": "all"}, "layers"),
    ({"kind": "system", "target": "resid_post", "noise": "gaussian", "scale": 1, "eval": "x"}, "eval"),
])
def test_bad_perturbations_name_the_field(obj, field):
    with pytest.raises(ProtocolError) as error:
        Perturbation.from_json(obj)
    assert (error.value.code, error.value.field) == ("bad_field", field)
