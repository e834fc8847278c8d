"""The plain-PyTorch reference GPT that our training step is measured against (no megatron-core).

What a practitioner writes in twenty lines (nanoGPT style): pre-LayerNorm blocks,
``scaled_dot_product_attention`` with causal masking, GeLU MLP, learned positions, tied embeddings,
dropout on attention and residual paths, bf16 autocast over fp32 weights, PyTorch's fused AdamW,
gradient clipping, gradient accumulation over the micro batches of a global batch. Same shapes and
FLOP convention (``megatron/training/flops.py``) as ``pretrain_gpt.py``, so the TFLOP/s compare.
Random tokens: the input does not change the work. A Llama-shaped model takes grouped-query attention
(``--num-query-groups``), ``--swiglu`` with ``--ffn-hidden-size``, ``--normalization RMSNorm`` and
``--disable-bias-linear``; its positions stay learned (RoPE's elementwise work is small beside the GEMMs).
``--fp8``: the blocks' linears in FP8 by torchao's float8 training as its documentation shows it
(``convert_to_float8_training``, ``--fp8-recipe`` tensorwise or rowwise), best under ``--compile``.

    python bench/reference_gpt.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
        --seq-length 1024 --vocab-size 8192 --micro-batch-size 4 --global-batch-size 32 [--compile] [--fp8]

Prints one line: ms per iteration (mean over the timed iterations, after the warm-up) and TFLOP/s per GPU.
Under ``torchrun --nproc_per_node N`` it trains data-parallel with PyTorch's DistributedDataParallel (NCCL,
gradient all-reduce overlapped with the backward, skipped on all but the last micro batch of an iteration):
the reference that the parallel layouts are measured against (``bench/layouts.sh``).
"""

import argparse
import contextlib
import os
import sys
import time
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.training.flops import training_flops_per_iteration  # (plain Python, no megatron-core)


def swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        hidden, bias = args.hidden_size, not args.disable_bias_linear
        self.heads, self.groups, self.dropout = args.num_attention_heads, args.num_query_groups, args.dropout
        self.head_dim = hidden // self.heads
        norm = nn.RMSNorm if args.normalization == "RMSNorm" else nn.LayerNorm
        self.ln_1, self.ln_2 = norm(hidden), norm(hidden)
        self.qkv = nn.Linear(hidden, (self.heads + 2 * self.groups) * self.head_dim, bias=bias)
        self.proj = nn.Linear(hidden, hidden, bias=bias)
        self.fc = nn.Linear(hidden, (2 if args.swiglu else 1) * args.ffn_hidden_size, bias=bias)
        self.fc_out = nn.Linear(args.ffn_hidden_size, hidden, bias=bias)
        self.activation = swiglu if args.swiglu else F.gelu

    def forward(self, x):
        b, s, h = x.shape
        widths = [self.heads * self.head_dim] + 2 * [self.groups * self.head_dim]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(widths, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0,
                                           enable_gqa=self.groups != self.heads)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)), self.dropout, self.training)
        return x + F.dropout(self.fc_out(self.activation(self.fc(self.ln_2(x)))), self.dropout, self.training)


class ReferenceGPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        hidden, vocab = args.hidden_size, args.vocab_size
        self.embed, self.position = nn.Embedding(vocab, hidden), nn.Embedding(args.seq_length, hidden)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.ln_f, self.dropout = nn.LayerNorm(hidden), args.dropout
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens, labels):
        x = self.embed(tokens) + self.position(torch.arange(tokens.size(1), device=tokens.device))
        x = F.dropout(x, self.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.embed.weight.t()  # tied output layer
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("num-layers", 24), ("hidden-size", 1024), ("num-attention-heads", 16),
                          ("seq-length", 1024), ("vocab-size", 8192), ("micro-batch-size", 4),
                          ("global-batch-size", 32), ("iterations", 20), ("warmup", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dropout", type=float, default=0.1, help="attention and hidden dropout (Megatron's default)")
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    parser.add_argument("--num-query-groups", type=int, default=None, help="default: one per head (no GQA)")
    parser.add_argument("--swiglu", action="store_true")
    parser.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    parser.add_argument("--disable-bias-linear", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--fp8", action="store_true", help="the blocks' linears in FP8 (torchao's float8 training)")
    parser.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise"], default="tensorwise")
    args = parser.parse_args()
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.num_query_groups = args.num_query_groups or args.num_attention_heads
    return args


def to_float8(model, recipe):
    """torchao's float8 training on every linear of the blocks (the tied output layer is a matmul, no nn.Linear)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/reference_gpt.py: error: needs a CUDA GPU")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.global_batch_size % (args.micro_batch_size * world):
        sys.exit(f"bench/reference_gpt.py: error: --global-batch-size {args.global_batch_size} is not a multiple of "
                 f"--micro-batch-size {args.micro_batch_size} x {world} processes")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        torch.distributed.init_process_group("nccl")
    torch.manual_seed(0)
    model = ReferenceGPT(args).cuda()
    if args.fp8:
        to_float8(model, args.fp8_recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.5e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    step_model = torch.compile(model) if args.compile else model
    accumulation = args.global_batch_size // (args.micro_batch_size * world)
    shape = (args.micro_batch_size, args.seq_length)

    def iteration():
        for index in range(accumulation):
            tokens = torch.randint(args.vocab_size, shape, device="cuda")
            last = index == accumulation - 1
            with (model.no_sync() if world > 1 and not last else contextlib.nullcontext()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = step_model(tokens, torch.roll(tokens, -1, dims=1))
                (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        iteration()
    torch.cuda.synchronize()
    start = time.perf_counter()  # timed as our log line times its window: no sync inside
    for _ in range(args.iterations):
        iteration()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iterations
    flops_args = types.SimpleNamespace(
        hidden_size=args.hidden_size, seq_length=args.seq_length, num_layers=args.num_layers,
        kv_channels=args.hidden_size // args.num_attention_heads, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, swiglu=args.swiglu, ffn_hidden_size=args.ffn_hidden_size,
        recompute_granularity=None, global_batch_size=args.global_batch_size)
    tflops = training_flops_per_iteration(flops_args, args.vocab_size) / seconds / world / 1e12
    if int(os.environ.get("RANK", "0")) == 0:
        name = (f"{'compiled' if args.compile else 'eager'}{f' fp8 {args.fp8_recipe}' if args.fp8 else ''}"
                f"{f' DDP x{world}' if world > 1 else ''}")
        print(f"reference {name}: {seconds * 1000:.1f} ms/iteration {tflops:.1f} TFLOP/s peak memory (MB): "
              f"{torch.cuda.max_memory_allocated() / 2**20:.0f}", flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
