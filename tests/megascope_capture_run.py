"""torchrun worker: capture every hook of a tiny GPT (full forward, and a KV-cache decode step) and save
rank 0's records to OUT_DIR/records.pt. Usage: megascope_capture_run.py OUT_DIR <pretrain_gpt flags>."""

import sys

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megascope_model import build, forward

from megascope.capture import Capture, CaptureSpec
from megascope.hooks import HOOK_NAMES

PROMPT_TOKENS, DECODE_AT = 12, 9


def capture(chunks, spec, tokens, **forward_kwargs):
    with Capture(chunks, spec) as active:
        forward(chunks, tokens, **forward_kwargs)
        return active.collect(step=0, token_offset=forward_kwargs.get("position_offset", 0))


def main():
    out_dir, argv = sys.argv[1], sys.argv[2:]
    args, chunks = build(argv)
    for chunk in chunks:
        chunk.eval()
    tokens = torch.randint(0, 100, (2, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    spec = CaptureSpec.from_json({"hooks": list(HOOK_NAMES), "logit_lens": True, "topk": 5})
    saved = {}
    with torch.no_grad():
        saved["full"] = capture(chunks, spec, tokens)
        if args.sequence_parallel:
            return _save(saved, out_dir)
        # KV cache: prefill the first DECODE_AT tokens, then one decode step of the next token.
        context = StaticInferenceContext(max_batch_size=2, max_sequence_length=16)
        forward(chunks, tokens[:, :DECODE_AT], inference_context=context)
        context.sequence_len_offset += DECODE_AT
        saved["decode"] = capture(chunks, spec, tokens[:, DECODE_AT:DECODE_AT + 1], inference_context=context,
                                  position_offset=DECODE_AT)
        if args.attention_backend == "unfused":
            saved["unfused_probs"] = _unfused_probs(chunks, tokens)
    _save(saved, out_dir)


def _save(saved, out_dir):
    if torch.distributed.get_rank() == 0:
        torch.save(saved, f"{out_dir}/records.pt")


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
