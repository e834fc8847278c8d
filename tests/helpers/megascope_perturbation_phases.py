"""Run by megascope_run.py: a tiny GPT's forward under seeded perturbations of every kind: the records
perturbed twice and after clear(), exact restores, and at one rank an autograd vs finite-difference check."""

import torch

from helpers.megascope_model import capture
from megascope.capture import CaptureSpec
from megascope.perturbations import Perturbation, PerturbationSet

PERTURBATIONS = [
    {"id": "qkv", "kind": "storage", "target": "attn.qkv", "noise": "gaussian", "scale": 0.05, "seed": 1,
     "layers": [1]},
    {"id": "emb", "kind": "storage", "target": "embed", "noise": "uniform", "scale": 0.1, "seed": 2},
    {"id": "fc2", "kind": "storage", "target": "mlp.fc2", "noise": "gaussian", "scale": 0.02, "seed": 3},
    {"id": "mlp", "kind": "calculation", "target": "mlp.out", "noise": "gaussian", "scale": 0.1, "seed": 4},
    {"id": "pre", "kind": "calculation", "target": "mlp.post", "noise": "uniform", "scale": 0.2, "seed": 5,
     "layers": [0, 3]},
    {"id": "c", "kind": "system", "target": "resid_post", "noise": "constant", "scale": 0.5, "layers": [1]},
    {"id": "r", "kind": "system", "target": "resid_post", "noise": "gaussian", "scale": 0.1, "seed": 6, "layers": [2]},
    {"id": "off", "kind": "system", "target": "resid_post", "noise": "gaussian", "scale": 9.0, "enabled": False},
]

# A constant on these shifts every hidden value of a token alike, which the next LayerNorm removes (the tiny
# model's --normalization is the default LayerNorm); on the others it changes the output distribution.
CONSTANT_REMOVED = [("system", "resid_post"), ("calculation", "embed"), ("calculation", "attn.out"),
                    ("calculation", "mlp.out"), ("storage", "embed"), ("storage", "attn.proj"), ("storage", "mlp.fc2")]
CONSTANT_FELT = [("calculation", "ln1"), ("calculation", "mlp.post"), ("storage", "attn.qkv")]

BITFLIPS = {"id": "bits", "kind": "storage", "target": "mlp.fc1", "noise": "bitflip", "scale": 0.01, "seed": 7}


def weights(chunks):
    return {name: p.detach().clone() for chunk in chunks for name, p in chunk.named_parameters()}


def gradient_check(chunks, active, perturbations, tokens):
    """d(sum of logits)/d(one weight) through the perturbed forward: autograd against a central difference."""
    weight = chunks[0].decoder.layers[0].mlp.linear_fc1.weight
    index = (3, 5)

    def loss():
        active.replace(perturbations)  # the same noise on every forward
        return chunks[0](tokens, torch.arange(tokens.size(1)).expand_as(tokens), None).double().square().mean()

    weight.grad = None
    loss().backward()
    analytic = weight.grad[index].item()
    step = 1e-2
    with torch.no_grad():
        original = weight[index].item()
        weight[index] = original + step
        up = loss().item()
        weight[index] = original - step
        down = loss().item()
        weight[index] = original
    return analytic, (up - down) / (2 * step)


def constant_effects(chunks, active, tokens):
    """(kind, target) -> the largest change of the output log-probabilities under a constant 0.5 there (log-
    probabilities: a tied output layer shifts every logit of a token alike, which changes no probability)."""
    spec = CaptureSpec.from_json({"hooks": ["logits"]})

    def log_probs():
        return torch.log_softmax(capture(chunks, spec, tokens)[0].values.double(), dim=-1)
    plain = log_probs()
    effects = {}
    for kind, target in CONSTANT_REMOVED + CONSTANT_FELT:
        active.replace([Perturbation.from_json({"kind": kind, "target": target, "noise": "constant", "scale": 0.5})])
        effects[(kind, target)] = (log_probs() - plain).abs().max().item()
        active.clear()
    return effects


def perturbation_phases(chunks, tokens):
    spec = CaptureSpec.from_json({"hooks": ["resid_post", "logits"]})
    perturbations = [Perturbation.from_json(obj) for obj in PERTURBATIONS]
    before = weights(chunks)
    active = PerturbationSet(chunks)
    saved = {}
    with torch.no_grad():
        saved["plain"] = capture(chunks, spec, tokens)
        active.replace(perturbations)
        saved["perturbed"] = capture(chunks, spec, tokens)
        active.replace(perturbations)
        saved["perturbed_again"] = capture(chunks, spec, tokens)
        active.clear()
        saved["restored_exactly"] = all(torch.equal(before[name], now) for name, now in weights(chunks).items())
        saved["restored"] = capture(chunks, spec, tokens)
        active.replace([Perturbation.from_json(BITFLIPS)])
        saved["bitflipped_weights"] = sum(int((before[name] != now).sum()) for name, now in weights(chunks).items())
        active.clear()
        saved["bitflips_restored_exactly"] = all(torch.equal(before[n], now) for n, now in weights(chunks).items())
    if torch.distributed.get_world_size() == 1:
        saved["gradient"] = gradient_check(chunks, active, perturbations, tokens)
        active.clear()
        with torch.no_grad():
            saved["constant_effects"] = constant_effects(chunks, active, tokens)
    return saved
