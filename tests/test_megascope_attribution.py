"""Direct logit attribution (megascope/attribution.py): in float64 on one process, the parts of a chosen token's
logit add up to the model's own logit and equal a reference computed from the component vectors, for an RMSNorm
and a LayerNorm model; at PP2, TP2 (grouped-query attention) and TP2 x PP2 with sequence parallelism they equal
one rank's (the runs the capture tests share); a request that is not true or false is refused naming the field.
The server's stream is tested in test_text_generation_server.py, the page's heatmap in test_megascope_page.py."""

import json

import pytest
import torch
from helpers.launch import REPO, run_script
from helpers.megascope_model import TINY_MODEL_FLAGS
from helpers.megascope_run import CHOSEN, PROMPT_TOKENS
from helpers.megascope_runs import REFERENCE, runs_root, saved

from megascope.capture_spec import parse_capture
from megascope.errors import ProtocolError


def test_float64_parts_add_up_to_the_logit_and_equal_the_reference_for_rmsnorm_and_layernorm():
    done = run_script("tests/helpers/attribution_reference.py", TINY_MODEL_FLAGS,
                      env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}, timeout=300)
    assert done.returncode == 0, done.stderr[-5000:]
    checked = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert checked == [{"norm": "RMSNorm", "checked": 4}, {"norm": "LayerNorm", "checked": 4}]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return runs_root(tmp_path_factory)


@pytest.mark.parametrize("layout, reference", list(REFERENCE.items()))
def test_every_layout_attributes_like_one_rank(layout, reference, tmp_root):
    got, want = saved(layout, tmp_root)["attribution"], saved(reference, tmp_root)["attribution"]
    assert [(a.prompt_index, a.position, a.token_id) for a in got] == [(0, PROMPT_TOKENS, 7), (1, PROMPT_TOKENS, 42)]
    logits = next(r for r in saved(reference, tmp_root)["capture"]["full"]
                  if r.hook == "logits" and r.prompt_index == 0)
    for ours, one_rank in zip(got, want):
        assert ours.values.shape == (4, 4 + 1)  # layers x (heads, MLP)
        torch.testing.assert_close(ours.values, one_rank.values, atol=1e-4, rtol=1e-4)
        for name in ("logit", "embed", "attn_bias", "final_norm_bias"):
            assert getattr(ours, name) == pytest.approx(getattr(one_rank, name), abs=1e-4, rel=1e-4), name
        assert ours.total() == pytest.approx(ours.logit, abs=1e-4)
    # the model's own float32 logit of the chosen token, at the last position
    assert want[0].logit == pytest.approx(float(logits.values[-1, int(CHOSEN[0])]), abs=1e-4)


@pytest.mark.parametrize("value", [1, "yes", None, [True]])
def test_attribution_must_be_true_or_false(value):
    with pytest.raises(ProtocolError) as error:
        parse_capture({"hooks": [], "attribution": value}, 4)
    assert (error.value.code, error.value.field) == ("bad_field", "capture.attribution")
    assert error.value.message == "attribution must be true or false"
    assert parse_capture({"hooks": [], "attribution": True}, 4).to_json()["attribution"] is True
