"""MegaScope capture on a real megatron-core GPT (pretrain_gpt's model_provider) under torchrun/gloo:
every hook's values at TP2 (grouped-query attention), PP2 and TP2xPP2 (sequence parallel) equal the
single-rank values; a KV-cache decode step captures what the full forward has at that token; the
attention pattern equals megatron-core's unfused softmax and the softmax of the captured q/k; the
logit lens of the last layer is the model's own output distribution."""

import math

import pytest
import torch
from helpers.megascope_runs import REFERENCE, runs_root, saved

DECODE_AT = 9


def _records(layout, root):
    return {**saved(layout, root)["capture"], "unfused_probs": saved(layout, root).get("unfused_probs")}


def _by_key(records):
    return {(r.hook, r.layer, r.prompt_index): r for r in records}


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return runs_root(tmp_path_factory)


@pytest.mark.parametrize("layout, reference", list(REFERENCE.items()))
def test_every_hook_equals_the_single_rank_capture(layout, reference, tmp_root):
    for phase in saved(layout, tmp_root)["capture"]:
        got, want = _by_key(_records(layout, tmp_root)[phase]), _by_key(_records(reference, tmp_root)[phase])
        assert got.keys() == want.keys()
        assert {hook for hook, _, _ in want} >= {"embed", "attn.q", "attn.pattern", "mlp.post", "logits", "logit_lens"}
        for key, record in want.items():
            assert got[key].token_start == record.token_start and got[key].dims == record.dims, key
            if key[0] == "logit_lens":  # near-ties may swap ranks: compare probabilities only
                torch.testing.assert_close(got[key].values[..., 1], record.values[..., 1], atol=1e-5, rtol=1e-4)
            else:
                torch.testing.assert_close(got[key].values, record.values, atol=1e-5, rtol=1e-4, msg=str(key))


@pytest.mark.parametrize("layout", ["single", "gqa_tp2", "pp2"])
def test_kv_cache_decode_step_captures_what_the_full_forward_has_at_that_token(layout, tmp_root):
    saved = _records(layout, tmp_root)
    full, decode = _by_key(saved["full"]), _by_key(saved["decode"])
    for key, record in decode.items():
        assert record.token_start == DECODE_AT and record.values.size(0) == 1, key
        row = full[key].values[DECODE_AT:DECODE_AT + 1]
        if key[0] == "attn.pattern":  # keys 0..DECODE_AT in the cache; the full row masks the later ones
            assert row[..., DECODE_AT + 1:].abs().max() == 0
            row = row[..., :DECODE_AT + 1]
        if key[0] == "logit_lens":
            row, record_values = row[..., 1], record.values[..., 1]
        else:
            record_values = record.values
        torch.testing.assert_close(record_values, row, atol=1e-5, rtol=1e-4, msg=str(key))


def test_pattern_equals_megatron_cores_unfused_softmax_and_the_captured_q_k(tmp_root):
    saved = _records("gqa_unfused", tmp_root)
    records = _by_key(saved["full"])
    for layer, probs in saved["unfused_probs"].items():  # [b, heads, sq, sk]
        for prompt in range(probs.size(0)):
            pattern = records[("attn.pattern", layer, prompt)].values  # [sq, heads, sk]
            torch.testing.assert_close(pattern, probs[prompt].permute(1, 0, 2).float(), atol=1e-6, rtol=1e-5)
            # learned absolute positions: no rotary, so the softmax of the captured (pre-rotary) q.k is the pattern
            q = records[("attn.q", layer, prompt)].values  # [s, heads, d]
            k = records[("attn.k", layer, prompt)].values.repeat_interleave(2, dim=1)  # 2 query groups of 4 heads
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.size(-1))
            scores = scores.masked_fill(torch.ones(q.size(0), q.size(0), dtype=torch.bool).triu(1), -math.inf)
            torch.testing.assert_close(scores.softmax(-1).permute(1, 0, 2), pattern, atol=1e-5, rtol=1e-4)


def test_logit_lens_of_the_last_layer_is_the_models_output_distribution(tmp_root):
    records = _by_key(_records("single", tmp_root)["full"])
    for prompt in (0, 1):
        lens = records[("logit_lens", 3, prompt)].values  # [s, k, (id, prob)]
        probs = records[("logits", None, prompt)].values.softmax(-1)
        top = probs.topk(lens.size(1), dim=-1)
        torch.testing.assert_close(lens[..., 1], top.values, atol=1e-5, rtol=1e-4)
        assert torch.equal(lens[..., 0].long(), top.indices)
