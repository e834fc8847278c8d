"""MegaScope activation patching on a real megatron-core GPT under torchrun/gloo (the shared runs of
megascope_runs.py): a prompt patched with its own activations is unchanged bit for bit; another prompt's last
residual gives that prompt's next-token logits; head patches write those heads only (TP-sharded query
groups); zero and mean ablations write what they say; every layout (TP2 GQA, PP2, TP2xPP2 sequence parallel)
computes what one rank does. Bad patches are ProtocolErrors naming the field."""

import pytest
import torch
from helpers.megascope_patching_phases import LAST
from helpers.megascope_runs import REFERENCE, runs_root, saved

from megascope.errors import ProtocolError
from megascope.patching import parse_patches

MODEL = {"num_layers": 4, "num_attention_heads": 4, "num_query_groups": 2}


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return runs_root(tmp_path_factory)


def _phases(layout, root):
    return {phase: {(r.hook, r.layer, r.prompt_index): r.values for r in records}
            for phase, records in saved(layout, root)["patching"].items()}


def test_a_prompt_patched_with_its_own_activations_is_unchanged_bit_for_bit(tmp_root):
    phases = _phases("single", tmp_root)
    assert phases["own"].keys() == phases["plain"].keys()
    for key, values in phases["plain"].items():
        assert torch.equal(phases["own"][key], values), key


def test_another_prompts_last_residual_gives_its_next_token_logits(tmp_root):
    plain, patched = (_phases("single", tmp_root)[phase] for phase in ("plain", "last_residual"))
    logits = patched[("logits", None, 0)]
    assert not torch.allclose(plain[("logits", None, 0)][LAST], plain[("logits", None, 1)][LAST], atol=1e-3)
    torch.testing.assert_close(logits[LAST], plain[("logits", None, 1)][LAST], atol=1e-6, rtol=1e-6)
    assert torch.equal(logits[:LAST], plain[("logits", None, 0)][:LAST])  # the other positions are untouched
    assert torch.equal(patched[("logits", None, 1)], plain[("logits", None, 1)])  # so is the source


def test_head_patches_write_those_heads_only(tmp_root):
    plain, patched = (_phases("single", tmp_root)[phase] for phase in ("plain", "heads"))
    query = patched[("attn.q", 1, 0)]  # [token, head, d_head]
    assert torch.equal(query[:, [1, 2]], patched[("attn.q", 1, 1)][:, [1, 2]])
    assert torch.equal(query[:, [0, 3]], plain[("attn.q", 1, 0)][:, [0, 3]])
    value, source = patched[("attn.v", 2, 0)], patched[("attn.v", 2, 1)]
    assert torch.equal(value[4:8, 1], source[4:8, 1])
    assert not torch.allclose(value[4:8, 0], source[4:8, 0]) and not torch.allclose(value[:4, 1], source[:4, 1])


def test_zero_and_mean_ablations_write_what_they_say(tmp_root):
    phases = _phases("single", tmp_root)
    plain, zero, mean = phases["plain"], phases["zero"], phases["mean"]
    for row in (0, 1):
        out = zero[("mlp.out", 2, row)]
        assert torch.equal(out[3:8], torch.zeros_like(out[3:8]))
        assert torch.equal(out[:3], plain[("mlp.out", 2, row)][:3])
        assert not torch.allclose(zero[("logits", None, row)][3:], plain[("logits", None, row)][3:], atol=1e-3)
    # the mean over both prompts, written into the prompts named: the embedding of prompt 1 at position 0 ...
    embed = [plain[("embed", None, row)] for row in (0, 1)]
    torch.testing.assert_close(mean[("embed", None, 1)][0], (embed[0][0] + embed[1][0]) / 2, atol=1e-7, rtol=0)
    assert torch.equal(mean[("embed", None, 1)][1:], embed[1][1:]) and torch.equal(mean[("embed", None, 0)], embed[0])
    # ... and layer 1's attention output of prompt 0 (prompt 0 reads as in the plain run up to there)
    both = (plain[("attn.out", 1, 0)] + mean[("attn.out", 1, 1)]) / 2
    torch.testing.assert_close(mean[("attn.out", 1, 0)], both, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layout, reference", list(REFERENCE.items()))
def test_every_layout_patches_what_one_rank_patches(layout, reference, tmp_root):
    got, want = _phases(layout, tmp_root), _phases(reference, tmp_root)
    for phase, records in want.items():
        assert got[phase].keys() == records.keys()
        for key, values in records.items():
            torch.testing.assert_close(got[phase][key], values, atol=1e-5, rtol=1e-4, msg=f"{phase} {key}")


@pytest.mark.parametrize("obj, code, field", [
    ({"hook": "attn.pattern", "source": "zero"}, "bad_hook", "patch.0.hook"),
    ({"source": "zero"}, "bad_field", "patch.0.hook"),
    ({"hook": "resid_mid", "source": "zero"}, "bad_hook", "patch.0.hook"),
    ({"hook": "blocks.1.resid_post", "source": "zero"}, "bad_hook", "patch.0.hook"),
    ({"hook": "resid_post", "source": "ones"}, "bad_field", "patch.0.source"),
    ({"hook": "resid_post", "source": {"prompt": 5}}, "bad_field", "patch.0.source.prompt"),
    ({"hook": "resid_post", "source": {"prompt": -1}}, "bad_field", "patch.0.source.prompt"),
    ({"hook": "resid_post", "source": {"prompt": 0, "position": 3}}, "bad_field", "patch.0.source"),
    ({"hook": "resid_post", "source": "zero", "layers": [4]}, "bad_field", "patch.0.layers"),
    ({"hook": "embed", "source": "zero", "layers": [0]}, "bad_field", "patch.0.layers"),
    ({"hook": "resid_post", "source": "zero", "heads": [0]}, "bad_field", "patch.0.heads"),
    ({"hook": "attn.q", "source": "zero", "heads": [4]}, "bad_field", "patch.0.heads"),
    ({"hook": "attn.k", "source": "zero", "heads": [2]}, "bad_field", "patch.0.heads"),  # 2 key/value heads
    ({"hook": "resid_post", "source": "zero", "positions": "last"}, "bad_field", "patch.0.positions"),
    ({"hook": "resid_post", "source": "zero", "positions": [1, 1]}, "bad_field", "patch.0.positions"),
    ({"hook": "resid_post", "source": "zero", "prompts": [2]}, "bad_field", "patch.0.prompts"),
    ({"hook": "resid_post", "source": "zero", "code": "import os"}, "bad_field", "patch.0.code"),
    ("resid_post", "bad_field", "patch.0"),
])
def test_bad_patches_name_the_field(obj, code, field):
    with pytest.raises(ProtocolError) as error:
        parse_patches([obj], MODEL, 2)
    assert (error.value.code, error.value.field) == (code, field), error.value.message


def test_a_patch_from_the_only_prompt_says_what_to_do():
    with pytest.raises(ProtocolError) as error:
        parse_patches([{"hook": "resid_post", "source": {"prompt": 0}}], MODEL, 1)
    assert error.value.field == "patch.0.prompts" and "add one" in error.value.message
    own = parse_patches([{"hook": "attn.k", "heads": [1], "source": {"prompt": 0}, "prompts": [0]}], MODEL, 1)
    assert [patch.to_json() for patch in own] == [{"hook": "attn.k", "source": {"prompt": 0}, "layers": None,
                                                   "heads": [1], "positions": None, "prompts": [0]}]
