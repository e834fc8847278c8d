"""Core attention through PyTorch's ``scaled_dot_product_attention``: the local implementation's fast path.

megatron-core's local ``DotProductAttention`` materializes the [b, heads, s, s] scores, masks them
with ``masked_fill``, and runs the softmax in fp32 around two batched matmuls: more than half the GPU
time of a GPT step. ``SDPAttention`` has the same constructor and forward signature, so it plugs into
the layer spec's ``core_attention`` slot, and lets PyTorch pick a flash / cuDNN / memory-efficient
kernel (``--attention-backend auto``) or the one kernel family the user names.

Masks keep megatron-core's convention (``True`` = masked out). Dropout draws from the tensor-parallel
RNG stream exactly where ``DotProductAttention`` does, so TP ranks drop different heads.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel


class SDPAttention(MegatronModule):
    """megatron-core core attention computed by ``F.scaled_dot_product_attention``.

    ``kernels``: the SDPA backends PyTorch may choose from (None: all of them)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, kernels=None):
        super().__init__(config=config)
        # Validation refuses these combinations with a clear line first; these guard other callers.
        assert config.context_parallel_size == 1, "SDPAttention does not implement context parallelism"
        assert config.window_size is None, "SDPAttention does not implement sliding-window attention"
        assert config.softmax_type == "vanilla", "SDPAttention implements the vanilla softmax only"
        tp_group = pg_collection.tp if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_group()
        tp_size = tp_group.size()
        self.attn_mask_type = attn_mask_type
        self.hidden_size_per_partition = divide(config.kv_channels * config.num_attention_heads, tp_size)
        # With query-key layer scaling DotProductAttention divides the scores by the layer number and
        # multiplies them back inside its fp32 softmax: the net scale is the plain one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.kernels = kernels

    def _mask_arguments(self, attention_mask, attn_mask_type, sq, sk, device):
        """(attn_mask, is_causal) for SDPA from megatron-core's mask and mask type."""
        if attention_mask is not None:
            attend = ~attention_mask
            # A query that may attend to nothing (a padding row of BERT's [b, 1, s, s] mask) gives
            # NaN in some kernels; its output is never used, so let it attend everywhere instead.
            return attend | ~attend.any(dim=-1, keepdim=True), False
        if attn_mask_type != AttnMaskType.causal or sq == 1:
            return None, False
        if sq == sk:
            return None, True
        # Queries are the last sq of sk positions (generation with a KV cache): causal from the end.
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq), False

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [sq, b, heads, d], key/value [sk, b, groups, d] -> context [sq, b, heads * d]."""
        assert packed_seq_params is None and attention_bias is None, \
            "SDPAttention supports neither packed sequences nor attention bias"
        sq, batch, sk = query.size(0), query.size(1), key.size(0)
        attn_mask, is_causal = self._mask_arguments(
            attention_mask, attn_mask_type or self.attn_mask_type, sq, sk, query.device)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        dropout_p = self.dropout_p if self.training else 0.0
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 and not self.config.sequence_parallel \
            else contextlib.nullcontext()
        kernels = sdpa_kernel(self.kernels) if self.kernels is not None else contextlib.nullcontext()
        with rng, kernels:
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale,
                enable_gqa=k.size(1) != q.size(1))
        return context.permute(2, 0, 1, 3).reshape(sq, batch, self.hidden_size_per_partition)


# --attention-backend of the local implementation -> the SDPA kernels it may use (None: any).
SDPA_KERNELS = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
}
