"""One process, no launcher: megascope/attribution.py on a tiny GPT in float64 against a reference computed here
from the model's own tensors, for a model with RMSNorm and one with LayerNorm (megatron's model-parallel state is
rebuilt between them). Prints one JSON line per model: {"norm", "checked"}; any mismatch raises.
Usage: attribution_reference.py <pretrain_gpt flags of the tiny model>."""

import json
import sys

import torch
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
)

from helpers.megascope_model import build
from megascope.attribution import Attribution

PROMPTS = torch.tensor([[5, 17, 3, 60, 22, 9], [41, 2, 88, 13, 70, 31]])


def reference_parts(model, tokens, chosen):
    """{"embed", "heads" [layers, b, heads], "attn_bias" [layers, b], "mlp" [layers, b], "final_norm_bias",
    "logit"} of a float64 forward, computed from the component vectors themselves: each one through the final
    norm linearised at the residual, times the chosen token's output row."""
    config = model.config
    vectors, handles = {}, []

    def keep(name):
        return lambda _m, inputs, output: vectors.__setitem__(name, (inputs, output))

    handles.append(model.embedding.register_forward_hook(keep("embed")))
    handles.append(model.decoder.final_layernorm.register_forward_hook(keep("final_norm")))
    for layer in model.decoder.layers:
        handles.append(layer.self_attention.linear_proj.register_forward_hook(keep(f"proj{layer.layer_number}")))
        handles.append(layer.mlp.register_forward_hook(keep(f"mlp{layer.layer_number}")))
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    logits = model(tokens, positions, None)
    for handle in handles:
        handle.remove()

    norm = model.decoder.final_layernorm
    (residual,), _ = vectors["final_norm"]
    residual = residual[-1]
    untied = model.output_layer.weight
    rows = (untied if untied is not None else model.embedding.word_embeddings.weight)[chosen]  # [b, hidden]
    layer_norm = config.normalization == "LayerNorm"

    def through_norm(component):  # the norm's linear part at the residual, then the chosen rows
        if layer_norm:
            component = component - component.mean(-1, keepdim=True)
            scale = torch.sqrt(residual.var(-1, unbiased=False, keepdim=True) + norm.eps)
        else:
            scale = torch.sqrt(residual.pow(2).mean(-1, keepdim=True) + norm.eps)
        return (norm.weight * component / scale * rows).sum(-1)

    heads, attn_bias, mlp, total = [], [], [], vectors["embed"][1][-1].clone()
    head_dim = config.kv_channels
    for layer in model.decoder.layers:
        projection = layer.self_attention.linear_proj
        (context,), (out, bias) = vectors[f"proj{layer.layer_number}"]
        context = context[-1]
        per_head = [context[:, h * head_dim:(h + 1) * head_dim]
                    @ projection.weight[:, h * head_dim:(h + 1) * head_dim].T
                    for h in range(config.num_attention_heads)]
        assert torch.allclose(sum(per_head), out[-1], rtol=0, atol=1e-12)  # the heads tile the projection
        heads.append(torch.stack([through_norm(vector) for vector in per_head], dim=-1))
        attn_bias.append(through_norm(bias.expand(context.size(0), -1)))
        mlp_out, mlp_bias = vectors[f"mlp{layer.layer_number}"][1]
        mlp.append(through_norm(mlp_out[-1] + mlp_bias))
        total = total + out[-1] + bias + mlp_out[-1] + mlp_bias
    assert torch.allclose(total, residual, rtol=0, atol=1e-10), "the components do not add up to the residual"
    return {"embed": through_norm(vectors["embed"][1][-1]), "heads": torch.stack(heads),
            "attn_bias": torch.stack(attn_bias),
            "mlp": torch.stack(mlp), "final_norm_bias": (norm.bias * rows).sum(-1) if layer_norm else torch.zeros(2),
            "logit": logits[:, -1].gather(-1, chosen[:, None]).squeeze(-1)}


def check(model, chosen):
    with torch.no_grad():
        reference = reference_parts(model, PROMPTS, chosen)
        with Attribution([model]) as attribution:
            model(PROMPTS, torch.arange(PROMPTS.size(1)).expand_as(PROMPTS), None)
            results = attribution.collect(chosen, [0, 1], PROMPTS.size(1))
    for row, result in enumerate(results):
        assert (result.prompt_index, result.position, result.token_id) == (row, PROMPTS.size(1), int(chosen[row]))
        logit = float(reference["logit"][row])
        assert abs(result.logit - logit) < 1e-9 * max(1.0, abs(logit)), (result.logit, logit)
        assert abs(result.total() - logit) < 1e-9 * max(1.0, abs(logit)), (result.total(), logit)
        expected = torch.cat([reference["heads"][:, row], reference["mlp"][:, row, None]], dim=1)
        torch.testing.assert_close(result.values, expected, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(torch.tensor(result.attn_bias, dtype=torch.float64), reference["attn_bias"][:, row],
                                   rtol=1e-9, atol=1e-12)
        for name in ("embed", "final_norm_bias"):
            assert abs(getattr(result, name) - float(reference[name][row])) < 1e-9, name
        assert all(result.attn_bias) and (result.final_norm_bias != 0) == (model.config.normalization == "LayerNorm")
    return len(results)


def main():
    # RMSNorm with the output layer tied to the word embedding, LayerNorm with its own output layer
    for normalization, flags in (("RMSNorm", []), ("LayerNorm", ["--untie-embeddings-and-output-weights"])):
        _, chunks = build([*sys.argv[1:], "--normalization", normalization, *flags])
        model = chunks[0].double().eval()
        with torch.no_grad():  # biases start at 0 and norm weights at 1: make every part of the logit count
            generator = torch.Generator().manual_seed(1)
            for name, parameter in model.named_parameters():
                if name.endswith("bias") or "layernorm" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
        argmax = model(PROMPTS, torch.arange(PROMPTS.size(1)).expand_as(PROMPTS), None)[:, -1].argmax(-1)
        checked = check(model, argmax) + check(model, torch.tensor([7, 99]))  # the likeliest and unlikely ones
        print(json.dumps({"norm": normalization, "checked": checked}), flush=True)
        parallel_state.destroy_model_parallel()  # the next model initializes megatron again
        destroy_num_microbatches_calculator()


if __name__ == "__main__":
    main()
