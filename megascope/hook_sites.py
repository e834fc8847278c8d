"""MegaScope's hook sites: the one table of every place in megatron-core's GPTModel (local layer spec) that
MegaScope reads or writes, each under one name that every feature and the protocol use.

Per site: where its module is in a GPTModel (``decoder.layers.{l}`` marks a per-layer site), what is read
there, how a tensor-parallel rank holds it, its dims after the token dim, and what the features may do with it:
capture it, patch it, perturb it (which perturbation kinds) and whether direct logit attribution has a part
for it. Capture, patching, perturbations, attribution and the welcome message all look sites up here; the
table of docs/megascope_protocol.md ("Hook sites") is checked against this one by the tests.
"""

from dataclasses import dataclass
from typing import TypedDict

# How a tensor-parallel rank holds what a site reads: capture gathers by it, noise is drawn for the whole.
HIDDEN, COLUMNS, HEADS, FUSED_QKV = "hidden", "columns", "heads", "fused_qkv"

# What is read at a site's module. A site can be patched where what it reads is a module's output or input that
# the rest of the model reads: writing it there is the patch.
OUTPUT = "output"
OUTPUT_PLUS_BIAS = "output plus its bias"
INPUT = "input"
QUERY_COLUMNS = "output: the query heads' columns"
KEY_COLUMNS = "output: the key heads' columns"
VALUE_COLUMNS = "output: the value heads' columns"
SOFTMAX = "softmax recomputed from its query and key inputs"
WEIGHTS = "weights and biases"
FUSED_QKV_READS = (QUERY_COLUMNS, KEY_COLUMNS, VALUE_COLUMNS)

# Perturbation kinds: storage adds noise to the parameters of the site's ``weights`` module; calculation to
# what the site reads, in every forward; system to the residual stream (the layer output).
STORAGE, CALCULATION, SYSTEM = "storage", "calculation", "system"
PERTURBATION_KINDS = (STORAGE, CALCULATION, SYSTEM)

LAYER = "decoder.layers.{l}"  # a per-layer site's module is this transformer layer or one of its submodules


@dataclass(frozen=True)
class HookSite:
    name: str
    module: str                 # its module's path in a GPTModel
    reads: str
    layout: str | None          # None: nothing is read in the forward (a storage-only site)
    dims: tuple = ()
    capture: bool = False
    patch: bool = False
    perturb: tuple = ()         # the perturbation kinds that may target it
    attribution: bool = False   # direct logit attribution has a part for it
    weights: str | None = None  # storage perturbations: the module whose parameters get the noise

    @property
    def per_layer(self) -> bool:
        return self.module == LAYER or self.module.startswith(LAYER + ".")

    @property
    def path_in_layer(self) -> str:
        """A per-layer site's module path inside its transformer layer ("" for the layer itself)."""
        return self.module[len(LAYER) + 1:]


def _layer(path: str = "") -> str:
    return f"{LAYER}.{path}" if path else LAYER


class _CaptureAndPatch(TypedDict):  # HookSite's keywords, typed so that the checker knows what ** passes
    capture: bool
    patch: bool


_CAPTURED_AND_PATCHED: _CaptureAndPatch = {"capture": True, "patch": True}
HOOK_SITES = {site.name: site for site in (  # in the order of the forward
    HookSite("embed", "embedding", OUTPUT, HIDDEN, ("hidden",), **_CAPTURED_AND_PATCHED,
             perturb=(STORAGE, CALCULATION), attribution=True, weights="embedding.word_embeddings"),
    HookSite("ln1", _layer("input_layernorm"), OUTPUT, HIDDEN, ("hidden",), **_CAPTURED_AND_PATCHED,
             perturb=(STORAGE, CALCULATION), weights=_layer("input_layernorm")),
    HookSite("attn.qkv", _layer("self_attention.linear_qkv"), WEIGHTS, None, perturb=(STORAGE,),
             weights=_layer("self_attention.linear_qkv")),
    HookSite("attn.q", _layer("self_attention.linear_qkv"), QUERY_COLUMNS, FUSED_QKV, ("head", "d_head"),
             **_CAPTURED_AND_PATCHED),
    HookSite("attn.k", _layer("self_attention.linear_qkv"), KEY_COLUMNS, FUSED_QKV, ("head", "d_head"),
             **_CAPTURED_AND_PATCHED),
    HookSite("attn.v", _layer("self_attention.linear_qkv"), VALUE_COLUMNS, FUSED_QKV, ("head", "d_head"),
             **_CAPTURED_AND_PATCHED),
    # The fused attention kernels never form the pattern: read only, recomputed.
    HookSite("attn.pattern", _layer("self_attention.core_attention"), SOFTMAX, HEADS, ("head", "key"),
             capture=True),
    HookSite("attn.proj", _layer("self_attention.linear_proj"), WEIGHTS, None, perturb=(STORAGE,),
             weights=_layer("self_attention.linear_proj")),
    HookSite("attn.out", _layer("self_attention"), OUTPUT_PLUS_BIAS, HIDDEN, ("hidden",), **_CAPTURED_AND_PATCHED,
             perturb=(CALCULATION,), attribution=True),
    # megatron-core adds the residual to the MLP's output in a function, not a module: read only.
    HookSite("resid_mid", _layer("pre_mlp_layernorm"), INPUT, HIDDEN, ("hidden",), capture=True),
    HookSite("ln2", _layer("pre_mlp_layernorm"), WEIGHTS, None, perturb=(STORAGE,),
             weights=_layer("pre_mlp_layernorm")),
    HookSite("mlp.fc1", _layer("mlp.linear_fc1"), WEIGHTS, None, perturb=(STORAGE,), weights=_layer("mlp.linear_fc1")),
    # TransformerLens's mlp.hook_post: the activation's output, which the output projection reads.
    HookSite("mlp.post", _layer("mlp.linear_fc2"), INPUT, COLUMNS, ("ffn",), **_CAPTURED_AND_PATCHED,
             perturb=(CALCULATION,)),
    HookSite("mlp.fc2", _layer("mlp.linear_fc2"), WEIGHTS, None, perturb=(STORAGE,), weights=_layer("mlp.linear_fc2")),
    HookSite("mlp.out", _layer("mlp"), OUTPUT_PLUS_BIAS, HIDDEN, ("hidden",), **_CAPTURED_AND_PATCHED,
             perturb=(CALCULATION,), attribution=True),
    HookSite("resid_post", _layer(), OUTPUT, HIDDEN, ("hidden",), **_CAPTURED_AND_PATCHED, perturb=(SYSTEM,)),
    HookSite("final_norm", "decoder.final_layernorm", OUTPUT, HIDDEN, ("hidden",), **_CAPTURED_AND_PATCHED,
             perturb=(CALCULATION,), attribution=True),
    # A patched logits row would only be the source's logits.
    HookSite("logits", "output_layer", OUTPUT, COLUMNS, ("vocab",), capture=True),
)}

# Names of earlier protocol versions, still taken and answered with the current name.
RENAMED = {"resid": "resid_post",  # protocol 2's system perturbation target
           "mlp.pre": "mlp.post"}  # protocol 3's: TransformerLens's mlp.hook_pre is the activation's input
# Old names taken for one more release, and why they go: the welcome says so.
DEPRECATED = {"mlp.pre": "renamed mlp.post, TransformerLens's name for the activation's output (its mlp.hook_pre is "
                         "the activation's input); mlp.pre is taken until the next release"}


def current_name(name):
    """A hook name as the current protocol calls it (an earlier version's name mapped; anything else as it is)."""
    return RENAMED.get(name, name) if isinstance(name, str) else name

CAPTURED = tuple(name for name, site in HOOK_SITES.items() if site.capture)
PATCHABLE = tuple(name for name, site in HOOK_SITES.items() if site.patch)
PERTURBATION_TARGETS = {kind: tuple(name for name, site in HOOK_SITES.items() if kind in site.perturb)
                        for kind in PERTURBATION_KINDS}


def full_hook_name(hook: str, layer) -> str:
    """TransformerLens-style full name: ``blocks.{layer}.{hook}`` for per-layer hooks."""
    return hook if layer is None else f"blocks.{layer}.{hook}"


def captured_full_names() -> list:
    """Every captured site's full name, ``{l}`` standing for the layer (the welcome's ``hooks``)."""
    return [full_hook_name(name, "{l}" if HOOK_SITES[name].per_layer else None) for name in CAPTURED]


def global_layer_index(layer) -> int:
    return layer.layer_number - 1  # megatron-core counts layers from 1 across all pipeline stages


def site_modules(model, site: HookSite, wants_layer=None):
    """(global layer index or None, module) of every module of ``site`` in this stage's GPTModel ``model``: one
    per layer (those ``wants_layer`` accepts) for a per-layer site; for another, its module where this stage
    has it (the embedding is on the first stage, the final norm and output layer on the last; a model may have
    no final norm)."""
    if site.per_layer:
        for layer in model.decoder.layers:
            index = global_layer_index(layer)
            if wants_layer is None or wants_layer(index):
                yield index, layer.get_submodule(site.path_in_layer)
        return
    if not (model.pre_process if site.name == "embed" else model.post_process):
        return
    module = model
    for part in site.module.split("."):
        module = getattr(module, part, None)
    if module is not None:
        yield None, module
