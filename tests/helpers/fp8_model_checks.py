"""Measures a tiny GPT built with FP8 linears against the same GPT in bf16, in one CPU process (gloo, world 1),
and prints them as one JSON object for tests/test_fp8_linears.py to judge.

    python tests/helpers/fp8_model_checks.py CHECKPOINT_DIR

The flags check refuses --fp8-format on CPU (no FP8 tensor cores), so the FP8 models are built by pretrain_gpt's
model_provider from validated bf16 flags with the FP8 flags set afterwards, as a GPU host's validation leaves them.
PyTorch's CPU build runs torch._scaled_mm, so the FP8 GEMMs here are the real ones, only slower.
"""

import megatron.training  # noqa: F401

# isort: split
import functools
import json
import sys
from pathlib import Path
from unittest import mock

import torch
from megatron.core import dist_checkpointing

from helpers.megascope_model import TINY_MODEL_FLAGS, build
from megatron.training.model_setup import _build_chunks
from pretrain_gpt import model_provider

FORMATS, RECIPES = ("e4m3", "hybrid"), ("tensorwise", "rowwise")
BATCH, SEQ = 2, 16


def _gpt(args, fp8_format=None, fp8_recipe=None):
    args.fp8, args.fp8_recipe = fp8_format, fp8_recipe
    (chunk,) = _build_chunks(args, functools.partial(model_provider, args))
    return chunk.bfloat16()


def _signature(model):
    """Every state-dict entry's shape and dtype, and every sharded-state-dict key: what a checkpoint holds."""
    entries = {name: None if value is None else [list(value.shape), str(value.dtype)]
               for name, value in model.state_dict().items()}
    return {"state_dict": entries, "sharded_keys": sorted(model.sharded_state_dict())}


def _loss(model, tokens):
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return model(tokens, positions, None, labels=tokens).float().mean()


def _gemms(model, tokens):
    """(loss, the FP8 GEMMs of the forward and of the backward: their operands' dtypes and whether scaled per row)."""
    calls = []

    def scaled_mm(a, b, scale_a, scale_b, *args, **kwargs):
        calls.append([str(a.dtype), str(b.dtype), scale_a.numel() > 1])
        return real(a, b, scale_a, scale_b, *args, **kwargs)

    real = torch._scaled_mm
    with mock.patch.object(torch, "_scaled_mm", scaled_mm):
        loss = _loss(model, tokens)
        forward = len(calls)
        loss.backward()
    return loss.item(), calls[:forward], calls[forward:]


def _grad_agreement(fp8, bf16):
    """Per linear weight of the layers: the cosine between its FP8 and its bf16 gradient, and the FP8 grad's dtype."""
    reference = dict(bf16.named_parameters())
    return {name: [torch.nn.functional.cosine_similarity(p.grad.float().flatten(),
                                                         reference[name].grad.float().flatten(), dim=0).item(),
                   str(p.grad.dtype)]
            for name, p in fp8.named_parameters() if ".linear_" in name and name.endswith("weight")}


def _max_difference(model, other):
    theirs = dict(other.named_parameters())
    return max((p - theirs[name]).abs().max().item() for name, p in model.named_parameters())


def _load_into(model, directory):
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(directory)))


def _round_trip(args, tokens, directory):
    """An FP8 model that took a step, saved and loaded into a bf16 one; that one, after its own step, saved and
    loaded into a fresh FP8 one: how far each loaded model is from the saved one, before and after loading."""
    fp8, bf16 = _gpt(args, "hybrid", "tensorwise"), _gpt(args)
    report = {}
    for name, source, target in (("fp8_to_bf16", fp8, bf16), ("bf16_to_fp8", bf16, _gpt(args, "hybrid", "tensorwise"))):
        _loss(source, tokens).backward()
        with torch.no_grad():
            for p in source.parameters():
                p -= 0.1 * p.grad
        (directory / name).mkdir()
        dist_checkpointing.save(source.sharded_state_dict(), str(directory / name))
        before = _max_difference(target, source)
        _load_into(target, directory / name)
        report[name] = {"before": before, "after": _max_difference(target, source),
                        "loss_saved": _loss(source, tokens).item(), "loss_loaded": _loss(target, tokens).item()}
    return report


def main(directory):
    args, _ = build(TINY_MODEL_FLAGS + ["--bf16"])
    tokens = torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    bf16 = _gpt(args)
    bf16_loss = _loss(bf16, tokens)
    bf16_loss.backward()
    report = {"bf16": {"loss": bf16_loss.item(), **_signature(bf16)}, "fp8": {}}
    for fp8_format in FORMATS:
        for fp8_recipe in RECIPES:
            fp8 = _gpt(args, fp8_format, fp8_recipe)
            fp8.load_state_dict(bf16.state_dict())
            loss, forward, backward = _gemms(fp8, tokens)
            report["fp8"][f"{fp8_format} {fp8_recipe}"] = {
                "loss": loss, "forward_gemms": forward, "backward_gemms": backward,
                "grads": _grad_agreement(fp8, bf16), **_signature(fp8),
                "classes": {name: type(module).__name__ for name, module in fp8.named_modules()
                            if name.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                                              "output_layer", "word_embeddings"))}}
    report["round_trip"] = _round_trip(args, tokens, directory)
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
