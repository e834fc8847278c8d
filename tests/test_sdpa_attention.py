"""SDPAttention computes attention as megatron-core defines it: masks where True means masked out,
causal masking (also for the last queries of a longer key sequence), grouped-query attention, and
BERT's padding rows; checked against a float64 reference built from the definition."""

import math
import types

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from megatron.training.sdpa_attention import SDPAttention

HEADS, GROUPS, HEAD_DIM, BATCH = 4, 2, 8, 3
ONE_TP_RANK = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))


def _attention(mask_type, groups=HEADS):
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=groups, attention_dropout=0.0, use_cpu_initialization=True)
    return SDPAttention(config, layer_number=1, attn_mask_type=mask_type, attention_type="self",
                        pg_collection=ONE_TP_RANK)


def _reference(query, key, value, masked_out):
    """[s, b, heads, d] inputs in float64; ``masked_out`` [b, 1, sq, sk] (True: not attended)."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (query, key, value))
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    probs = scores.masked_fill(masked_out, float("-inf")).softmax(dim=-1)
    return (probs @ v).permute(2, 0, 1, 3).reshape(q.size(2), q.size(0), -1)


def _inputs(sq, sk, groups=HEADS):
    return (torch.randn(sq, BATCH, HEADS, HEAD_DIM), torch.randn(sk, BATCH, groups, HEAD_DIM),
            torch.randn(sk, BATCH, groups, HEAD_DIM))


@pytest.mark.parametrize("sq, sk", [(16, 16), (4, 16), (1, 16)])
def test_causal_attention_lets_each_query_see_the_keys_up_to_its_position(sq, sk):
    query, key, value = _inputs(sq, sk)
    out = _attention(AttnMaskType.causal)(query, key, value, attention_mask=None)
    # Query i is position sk - sq + i: it sees keys 0 .. sk - sq + i.
    masked_out = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq).logical_not()
    assert torch.allclose(out.double(), _reference(query, key, value, masked_out), atol=1e-5)


def test_grouped_query_attention_shares_each_key_value_group_among_its_heads():
    query, key, value = _inputs(16, 16, groups=GROUPS)
    out = _attention(AttnMaskType.causal, groups=GROUPS)(query, key, value, attention_mask=None)
    masked_out = torch.ones(16, 16, dtype=torch.bool).tril().logical_not()
    assert torch.allclose(out.double(), _reference(query, key, value, masked_out), atol=1e-5)


def test_padding_mask_hides_padded_keys_and_padded_rows_stay_finite():
    query, key, value = _inputs(12, 12)
    lengths = torch.tensor([12, 7, 3])
    valid = torch.arange(12)[None, :] < lengths[:, None]  # [b, s]
    masked_out = ~(valid[:, None, :, None] & valid[:, None, None, :])  # BERT's [b, 1, s, s] mask
    out = _attention(AttnMaskType.padding)(query, key, value, attention_mask=masked_out)
    assert torch.isfinite(out).all()
    reference = _reference(query, key, value, masked_out)
    for b, length in enumerate(lengths):  # rows of real tokens; padded rows are never used
        assert torch.allclose(out[:length, b].double(), reference[:length, b], atol=1e-5)
