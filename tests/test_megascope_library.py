"""MegaScope's declarative parts: capture specs and reductions are validated (bad input is a
ProtocolError naming the field), reductions compute what they say, PCA equals numpy's SVD."""

import numpy as np
import pytest
import torch

from megascope.capture_spec import CaptureSpec, parse_capture
from megascope.errors import ProtocolError
from megascope.pca import pca_2d
from megascope.perturbations import parse_perturbations
from megascope.reductions import Reduction


@pytest.mark.parametrize("text", ["mean", "bins(0)", "bins(5000)", "slice(3,3)", "slice(4)", "topk_abs(2,3)",
                                  "__import__('os')", "bins(n)", 7, None])
def test_malformed_or_unknown_reduction_is_a_bad_reduction_error(text):
    with pytest.raises(ProtocolError) as error:
        Reduction.parse(text)
    assert error.value.code == "bad_reduction" and error.value.field == "reduction"


def test_reductions_compute_what_they_say():
    values = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6) - 20  # [token, head, d_head]
    dims = ["head", "d_head"]
    assert torch.equal(Reduction.parse("norm").apply(values, dims)[0], values.norm(dim=-1))
    reduced, reduced_dims = Reduction.parse("mean_heads").apply(values, dims)
    assert torch.equal(reduced, values.mean(dim=1)) and reduced_dims == ["d_head"]
    assert torch.equal(Reduction.parse("slice(1,3)").apply(values, dims)[0], values[..., 1:3])
    assert torch.equal(Reduction.parse("bins(3)").apply(values, dims)[0],
                       values.reshape(2, 4, 3, 2).mean(dim=-1))
    pairs, pair_dims = Reduction.parse("topk_abs(2)").apply(torch.tensor([[1.0, -5.0, 3.0]]), ["hidden"])
    assert pairs.tolist() == [[[1.0, -5.0], [2.0, 3.0]]] and pair_dims == ["topk", "index_value"]
    assert Reduction.parse(" bins( 8 ) ") == Reduction("bins", (8,)) and str(Reduction("slice", (1, 3))) == "slice(1,3)"


@pytest.mark.parametrize("spec, code, field", [
    ({"hooks": ["attn.nope"]}, "bad_hook", "hooks"),
    ({"hooks": "embed"}, "bad_field", "hooks"),
    ({"hooks": ["embed"], "reduction": "mean_heads"}, "bad_reduction", "reduction"),
    ({"hooks": ["attn.q"], "reductions": {"attn.q": "bins(x)"}}, "bad_reduction", "reductions.attn.q"),
    ({"hooks": ["embed"], "reductions": {"logits": "norm"}}, "bad_field", "reductions"),
    ({"hooks": ["embed"], "layers": [3, 1]}, "bad_field", "layers"),
    ({"hooks": ["embed"], "tokens": [0]}, "bad_field", "tokens"),
    ({"hooks": ["embed"], "topk": 0}, "bad_field", "topk"),
    ({"hooks": ["embed"], "pca": {"hook": "resid_post", "layer": 1}}, "bad_field", "pca.hook"),
    ({"hooks": ["resid_post"], "pca": {"hook": "resid_post", "layer": "2"}}, "bad_field", "pca.layer"),
    ({"hooks": ["embed"], "pca": {"hook": "embed", "layer": 0}}, "bad_field", "pca.layer"),
    ({"hooks": ["embed"], "code": "print(1)"}, "bad_field", "code"),
])
def test_bad_capture_specs_name_the_field(spec, code, field):
    with pytest.raises(ProtocolError) as error:
        CaptureSpec.from_json(spec)
    assert (error.value.code, error.value.field) == (code, field)


def test_a_full_capture_spec_parses():
    spec = CaptureSpec.from_json({"hooks": ["attn.pattern", "resid_post", "mlp.out"], "layers": [1, 3],
                                  "tokens": [0, 8], "reduction": "norm",
                                  "reductions": {"attn.pattern": "mean_heads", "resid_post": "none"}, "topk": 3,
                                  "logit_lens": True, "pca": {"hook": "resid_post", "layer": 2}, "sample": 1})
    assert str(spec.reduction_for("attn.pattern")) == "mean_heads" and str(spec.reduction_for("mlp.out")) == "norm"
    assert CaptureSpec.from_json(spec.to_json()) == spec
    every_layer = CaptureSpec.from_json({"hooks": ["resid_post"], "pca": {"hook": "resid_post", "layer": None}})
    assert every_layer.pca.layer is None and CaptureSpec.from_json(every_layer.to_json()) == every_layer
    assert spec.wants_layer(2) and not spec.wants_layer(3) and spec.wants_token(7) and not spec.wants_token(8)


def test_a_messages_capture_and_perturbations_name_their_fields_inside_the_message():
    assert parse_capture(None, 2) is None
    with pytest.raises(ProtocolError) as error:
        parse_capture({"hooks": ["embed"], "pca": {"hook": "resid_post", "layer": 1}}, 2)
    assert error.value.field == "capture.pca.hook"
    good = {"kind": "system", "target": "resid_post", "noise": "constant", "scale": 1}
    with pytest.raises(ProtocolError) as error:
        parse_perturbations([good, {**good, "target": "ln2"}], 2)
    assert error.value.field == "perturbations.1.target"  # ln2 is a storage target only
    assert [p.to_json() for p in parse_perturbations([good], 2)] == [
        {"id": None, **good, "scale": 1.0, "seed": 0, "layers": None, "enabled": True}]  # normalised


@pytest.mark.parametrize("capture, field, words", [
    ({"hooks": ["resid_post"], "layers": [0, 99]}, "capture.layers", "past this model's 2 layers"),
    ({"hooks": ["resid_post"], "layers": [50, 99]}, "capture.layers", "0 <= start < end <= 2"),
    ({"hooks": ["resid_post"], "pca": {"hook": "resid_post", "layer": 99}}, "capture.pca.layer", "from 0 to 1"),
    ({"hooks": ["resid_post"], "reduction": "norm", "pca": {"hook": "resid_post", "layer": 0}}, "capture.pca.hook",
     "capture it with reduction none"),
])
def test_out_of_range_captures_are_refused_naming_the_valid_range(capture, field, words):
    with pytest.raises(ProtocolError) as error:
        parse_capture(capture, 2)
    assert (error.value.code, error.value.field) == ("bad_field", field) and words in error.value.message


def test_a_perturbation_of_a_layer_the_model_lacks_is_refused():
    with pytest.raises(ProtocolError) as error:
        parse_perturbations([{"kind": "system", "target": "resid_post", "noise": "constant", "scale": 1,
                              "layers": [1, 99]}], 2)
    assert error.value.field == "perturbations.0.layers" and "[99]" in error.value.message
    assert "from 0 to 1" in error.value.message


def test_pca_equals_numpys_svd():
    data = np.random.default_rng(0).normal(size=(40, 16)) @ np.diag(np.linspace(3, 0.1, 16))
    coords, ratio = pca_2d(torch.tensor(data, dtype=torch.float32))
    centered = data - data.mean(axis=0)
    u, s, vt = np.linalg.svd(centered, full_matrices=False)
    expected = centered @ vt[:2].T
    expected *= np.sign(vt[np.arange(2), np.abs(vt[:2]).argmax(axis=1)])  # the documented sign convention
    np.testing.assert_allclose(coords.numpy(), expected, atol=1e-4)
    np.testing.assert_allclose(ratio.numpy(), (s[:2] ** 2) / (s ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(pca_2d(data.astype(np.float32))[0].numpy(), coords.numpy())  # numpy input too
