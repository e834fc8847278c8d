"""--tp-comm-overlap: tensor parallelism's sequence-parallel collectives overlapped with the GEMMs they feed.

With sequence parallelism a column-parallel linear all-gathers its input along the sequence before its GEMM, and a
row-parallel linear reduce-scatters its GEMM's output; megatron-core's local layers run each collective, then the
GEMM (or the reverse), so the GPU idles on communication about ten times per layer. PyTorch's symmetric-memory
operators ``fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter`` split the sequence into one chunk per rank
and compute on the chunks already exchanged while the next ones travel (torchtitan's "async TP"). Here they replace
the collective and the GEMM in both directions:

- column-parallel (QKV, MLP fc1): forward all-gather + GEMM fused; backward the input gradient's GEMM +
  reduce-scatter fused, the weight gradient from the gathered input kept from the forward;
- row-parallel (attention projection, MLP fc2): forward GEMM + reduce-scatter fused; backward the output gradient's
  all-gather + the input gradient's GEMM fused, the weight gradient from that gathered gradient.

The layers keep megatron-core's parameters, initialization and checkpoints; only the forward and backward of the
sequence-parallel case change. Off the GPU the same functions run the collective and the GEMM one after the other
(megatron-core's own collectives), so a CPU run checks the gradients against the unfused layers.
"""

import copy
import warnings

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def _symmetric(group):
    """The group's name for the symmetric-memory operators, the group registered with them on first use."""
    from torch.distributed import _symmetric_memory

    name = group.group_name
    if not _symmetric_memory.is_symm_mem_enabled_for_group(name):
        with warnings.catch_warnings():  # newer PyTorch registers groups itself and deprecates the call
            warnings.simplefilter("ignore", FutureWarning)
            _symmetric_memory.enable_symm_mem_for_group(name)
    return name


def _all_gather_matmul(shard, weight_t, group):
    """(the input gathered along the sequence, that input @ ``weight_t``)."""
    if shard.is_cuda:
        gathered, (product,) = torch.ops.symm_mem.fused_all_gather_matmul(shard, [weight_t], 0, _symmetric(group))
        return gathered, product
    gathered = gather_from_sequence_parallel_region(shard, group=group)  # no autograd here: a plain all-gather
    return gathered, torch.matmul(gathered, weight_t)


def _matmul_reduce_scatter(inputs, weight_t, group):
    """(``inputs`` @ ``weight_t``) summed over the group and scattered along the sequence."""
    if inputs.is_cuda:
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(inputs, weight_t, "sum", 0, _symmetric(group))
    return reduce_scatter_to_sequence_parallel_region(torch.matmul(inputs, weight_t), group=group)


def _weight_grad(grad_output, inputs):
    """grad_output^T @ inputs over every token ([s, b, out] and [s, b, in] -> [out, in])."""
    return torch.matmul(grad_output.reshape(-1, grad_output.shape[-1]).t(), inputs.reshape(-1, inputs.shape[-1]))


class _AllGatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, weight, bias, group):
        gathered, output = _all_gather_matmul(shard, weight.t(), group)
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx, grad_output):
        gathered, weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grad_input = _matmul_reduce_scatter(grad_output, weight, ctx.group)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_input, _weight_grad(grad_output, gathered), grad_bias, None


class _LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, weight, group):
        ctx.save_for_backward(inputs, weight)
        ctx.group = group
        return _matmul_reduce_scatter(inputs, weight.t(), group)

    @staticmethod
    def backward(ctx, grad_output):
        inputs, weight = ctx.saved_tensors
        gathered_grad, grad_input = _all_gather_matmul(grad_output.contiguous(), weight, ctx.group)
        return grad_input, _weight_grad(gathered_grad, inputs), None


class OverlappedColumnParallelLinear(ColumnParallelLinear):
    """megatron-core's column-parallel linear; with sequence parallelism its all-gather overlaps its GEMM."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not (kwargs.get("sequence_parallel") and weight.requires_grad):
            return super()._forward_impl(input, weight, *args, **kwargs)
        return _AllGatherLinear.apply(input, weight, kwargs.get("bias"), self.tp_group)


class OverlappedRowParallelLinear(RowParallelLinear):
    """megatron-core's row-parallel linear; with sequence parallelism its reduce-scatter overlaps its GEMM."""

    def forward(self, input_):
        if not (self.sequence_parallel and self.weight.requires_grad and not self.explicit_expert_comm):
            return super().forward(input_)
        output = _LinearReduceScatter.apply(input_, self.weight, self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


def with_tp_comm_overlap(layer_spec):
    """A copy of a local GPT layer spec whose attention and MLP linears overlap their TP collectives."""
    layer_spec = copy.deepcopy(layer_spec)
    attention, mlp = layer_spec.submodules.self_attention.submodules, layer_spec.submodules.mlp.submodules
    attention.linear_qkv = mlp.linear_fc1 = OverlappedColumnParallelLinear
    attention.linear_proj = mlp.linear_fc2 = OverlappedRowParallelLinear
    return layer_spec
