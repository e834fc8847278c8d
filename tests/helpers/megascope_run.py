"""torchrun worker: capture every hook of a tiny GPT (full forward, and a KV-cache decode step), the direct logit
attribution of two chosen tokens at the last position, where each hook site's modules and weights are found, then
the perturbation phases (megascope_perturbation_phases.py) and the patching phases (megascope_patching_phases.py),
and save rank 0's results to OUT_DIR/saved.pt.
Usage: megascope_run.py OUT_DIR <pretrain_gpt flags>."""

import sys

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from helpers.megascope_model import build, capture, forward
from helpers.megascope_patching_phases import patching_phases
from helpers.megascope_perturbation_phases import perturbation_phases
from megascope.attribution import Attribution
from megascope.capture import CaptureSpec
from megascope.hook_sites import CAPTURED, HOOK_SITES, STORAGE, site_modules
from megascope.hooks import unwrap_model
from megascope.perturbations import Perturbation, PerturbationSet
from megatron.training.initialize import shutdown
from megatron.training.layout_invariant_init import global_parameter_names

PROMPT_TOKENS, DECODE_AT = 12, 9
CHOSEN = torch.tensor([7, 42])  # the tokens whose logits are attributed, one per prompt


def main():
    out_dir, argv = sys.argv[1], sys.argv[2:]
    args, chunks = build(argv)
    for chunk in chunks:
        chunk.eval()
    tokens = torch.randint(0, 100, (2, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    spec = CaptureSpec.from_json({"hooks": list(CAPTURED), "logit_lens": True, "topk": 5})
    saved = {"capture": {}}
    with torch.no_grad():
        saved["capture"]["full"] = capture(chunks, spec, tokens)
        with Attribution(chunks) as attribution:
            forward(chunks, tokens)
            saved["attribution"] = attribution.collect(CHOSEN, [0, 1], PROMPT_TOKENS)
        # Megatron runs no KV-cache decode under sequence parallelism (one token cannot be split).
        if not args.sequence_parallel:
            # KV cache: prefill the first DECODE_AT tokens, then one decode step of the next token.
            context = StaticInferenceContext(max_batch_size=2, max_sequence_length=16)
            forward(chunks, tokens[:, :DECODE_AT], inference_context=context)
            context.sequence_len_offset += DECODE_AT
            saved["capture"]["decode"] = capture(chunks, spec, tokens[:, DECODE_AT:DECODE_AT + 1],
                                                 inference_context=context, position_offset=DECODE_AT)
        if args.attention_backend == "unfused":
            saved["unfused_probs"] = _unfused_probs(chunks, tokens)
    saved["sites"] = _sites_found(chunks)
    saved["perturbation"] = perturbation_phases(chunks, tokens)
    with torch.no_grad():
        saved["patching"] = patching_phases(chunks, tokens)
    if torch.distributed.get_rank() == 0:
        torch.save(saved, f"{out_dir}/saved.pt")
    # End as the entry points do: every rank done, then the groups torn down. Before it, one run of this script
    # aborted in gloo ("terminate called without an active exception") with no error of its own.
    torch.distributed.barrier()
    shutdown()


def _sites_found(chunks):
    """site -> (the layers of this rank where its module is found, None for a layer-less site; the global names
    of the parameters a storage perturbation of it changes, None for a site that takes none)."""
    found = {}
    for name, site in HOOK_SITES.items():
        layers = [layer for chunk in chunks for layer, _ in site_modules(unwrap_model(chunk), site)]
        found[name] = (layers, _changed_by_storage_noise(chunks, name) if STORAGE in site.perturb else None)
    return found


def _changed_by_storage_noise(chunks, target):
    names = {name: global_name for chunk in chunks
             for name, global_name in global_parameter_names(unwrap_model(chunk)).items()}
    before = {name: p.detach().clone() for chunk in chunks for name, p in unwrap_model(chunk).named_parameters()}
    noise = PerturbationSet(chunks)
    noise.replace([Perturbation.from_json({"kind": STORAGE, "target": target, "noise": "constant", "scale": 1.0})])
    changed = {names[name] for chunk in chunks for name, p in unwrap_model(chunk).named_parameters()
               if not torch.equal(p, before[name])}
    noise.clear()
    return changed


def _unfused_probs(chunks, tokens):
    """megatron-core DotProductAttention's own softmax output per layer (one rank only)."""
    probs = {}
    layers = chunks[0].decoder.layers
    handles = [layer.self_attention.core_attention.scale_mask_softmax.register_forward_hook(
        lambda _m, _i, out, index=layer.layer_number - 1: probs.__setitem__(index, out.detach().clone()))
        for layer in layers]
    forward(chunks, tokens)
    for handle in handles:
        handle.remove()
    return probs


if __name__ == "__main__":
    main()
