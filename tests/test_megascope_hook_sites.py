"""MegaScope's one table of hook sites (megascope/hook_sites.py): the protocol document's table is the module's;
capture, patching and perturbations take exactly the sites the table gives them, under the names the welcome
declares; every site's module and weights are found in a real megatron-core GPT; and protocol 2's name of a
renamed site is still taken, answered with the new name."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.megascope_runs import runs_root, saved

from megascope.capture_spec import CaptureSpec
from megascope.errors import ProtocolError
from megascope.hook_sites import HOOK_SITES, RENAMED, STORAGE, full_hook_name
from megascope.patching import Patch
from megascope.perturbations import Perturbation, parse_perturbations
from megascope.welcome import welcome_info

PROTOCOL_DOC = Path(__file__).resolve().parents[1] / "docs" / "megascope_protocol.md"
TINY = SimpleNamespace(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=None,
                       tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1)


def markdown_table():
    """The table of docs/megascope_protocol.md's "Hook sites", as the module's table gives it."""
    def perturb(site):
        return ", ".join(f"{kind} (`{site.weights}`)" if kind == STORAGE and site.weights != site.module else kind
                         for kind in site.perturb)
    rows = ["| site | module | reads | dims | capture | patch | perturb | attribution |",
            "|---|---|---|---|---|---|---|---|"]
    for site in HOOK_SITES.values():
        marks = ["yes" if flag else "" for flag in (site.capture, site.patch)]
        rows.append(f"| `{site.name}` | `{site.module}` | {site.reads} | {', '.join(site.dims)} | {marks[0]} | "
                    f"{marks[1]} | {perturb(site)} | {'yes' if site.attribution else ''} |")
    return "\n".join(rows)


def test_the_protocol_documents_table_is_the_modules():
    documented = re.search(r"<!-- hook-sites:begin -->\n(.*?)\n<!-- hook-sites:end -->", PROTOCOL_DOC.read_text(),
                           re.DOTALL)
    assert documented, "docs/megascope_protocol.md has no table between <!-- hook-sites:begin/end -->"
    assert documented.group(1) == markdown_table(), \
        "docs/megascope_protocol.md's Hook sites table differs from megascope/hook_sites.py; it should read:\n" + \
        markdown_table()


def _taken(parse, obj):
    """True when ``parse`` takes ``obj``, else the refusal's (code, field)."""
    try:
        parse(obj)
        return True
    except ProtocolError as error:
        return error.code, error.field


@pytest.mark.parametrize("name", list(HOOK_SITES))
def test_each_feature_takes_a_site_exactly_where_the_table_says(name):
    site = HOOK_SITES[name]
    assert _taken(CaptureSpec.from_json, {"hooks": [name]}) == (True if site.capture else ("bad_hook", "hooks"))
    assert _taken(Patch.from_json, {"hook": name, "source": "zero"}) == (
        True if site.patch else ("bad_hook", "hook"))
    for kind in ("storage", "calculation", "system"):
        perturbation = {"kind": kind, "target": name, "noise": "gaussian", "scale": 1}
        assert _taken(Perturbation.from_json, perturbation) == (
            True if kind in site.perturb else ("bad_field", "target")), kind


def test_the_welcome_names_each_site_as_requests_do():
    welcome = welcome_info(TINY, 100)
    full_names = {full_hook_name(name, "{l}" if site.per_layer else None): name for name, site in HOOK_SITES.items()}
    hooks = [full_names[hook] for hook in welcome["hooks"]]
    assert hooks == [name for name, site in HOOK_SITES.items() if site.capture]
    assert welcome["perturbation_targets"] == {
        kind: [name for name, site in HOOK_SITES.items() if kind in site.perturb]
        for kind in ("storage", "calculation", "system")}
    # What calculation and system perturbations act on is read, so a capture shows it under the same name.
    acted_on = set(welcome["perturbation_targets"]["calculation"] + welcome["perturbation_targets"]["system"])
    assert acted_on <= set(hooks), acted_on - set(hooks)


def test_protocol_2s_resid_is_taken_and_answered_as_resid_post():
    assert RENAMED == {"resid": "resid_post", "mlp.pre": "mlp.post"}
    old = {"id": "r", "kind": "system", "target": "resid", "noise": "gaussian", "scale": 0.1, "seed": 6,
           "layers": [2]}
    # The parsed perturbation is what drives the model: equal objects, equal noise.
    assert Perturbation.from_json(old) == Perturbation.from_json({**old, "target": "resid_post"})
    assert parse_perturbations([old], 4)[0].to_json()["target"] == "resid_post"
    for kind in ("storage", "calculation"):  # the old name was a system target only
        assert _taken(Perturbation.from_json, {**old, "kind": kind}) == ("bad_field", "target")


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return runs_root(tmp_path_factory)


def test_every_sites_module_and_weights_are_found_in_a_real_gpt(tmp_root):
    """On a real megatron-core GPTModel of 4 layers: each site's module is found in every layer (or once), and a
    storage perturbation of a site changes exactly the parameters of its weights module, in every layer."""
    found = saved("single", tmp_root)["sites"]
    assert found.keys() == HOOK_SITES.keys()
    for name, (layers, changed) in found.items():
        site = HOOK_SITES[name]
        assert layers == ([0, 1, 2, 3] if site.per_layer else [None]), name
        if STORAGE in site.perturb:
            owners = {parameter.rpartition(".")[0] for parameter in changed}
            assert owners == {site.weights.format(l=layer) for layer in (range(4) if site.per_layer else [0])}, name
        else:
            assert changed is None


def test_protocol_3s_mlp_pre_is_taken_as_mlp_post_for_one_release_and_the_welcome_says_so():
    """TransformerLens's mlp.hook_pre is the activation's input; the site reads its output (mlp.hook_post)."""
    capture = {"hooks": ["mlp.pre", "resid_post"], "reductions": {"mlp.pre": "norm"}, "pca": None}
    assert CaptureSpec.from_json(capture) == CaptureSpec.from_json(
        {**capture, "hooks": ["mlp.post", "resid_post"], "reductions": {"mlp.post": "norm"}})
    assert CaptureSpec.from_json({"hooks": ["mlp.pre"], "pca": {"hook": "mlp.pre", "layer": 1}}).pca.hook == "mlp.post"
    patch = {"hook": "mlp.pre", "layers": [1], "source": "zero"}
    assert Patch.from_json(patch) == Patch.from_json({**patch, "hook": "mlp.post"})
    noise = {"id": "p", "kind": "calculation", "target": "mlp.pre", "noise": "gaussian", "scale": 0.1, "seed": 6}
    assert parse_perturbations([noise], 4)[0].to_json()["target"] == "mlp.post"
    deprecated = welcome_info(TINY, 1000)["deprecated"]
    assert list(deprecated) == ["mlp.pre"] and deprecated["mlp.pre"].startswith("renamed mlp.post")
