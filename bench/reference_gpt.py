"""The plain-PyTorch reference GPT that our training step is measured against (no megatron-core).

What a practitioner writes in twenty lines (nanoGPT style): pre-LayerNorm blocks,
``scaled_dot_product_attention`` with causal masking, GeLU MLP, learned positions, tied embeddings,
dropout on attention and residual paths, bf16 autocast over fp32 weights, PyTorch's fused AdamW,
gradient clipping, gradient accumulation over the micro batches of a global batch. Same shapes and
FLOP convention (``megatron/training/flops.py``) as ``pretrain_gpt.py``, so the TFLOP/s compare.
Random tokens: the input does not change the work.

    python bench/reference_gpt.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
        --seq-length 1024 --vocab-size 8192 --micro-batch-size 4 --global-batch-size 32 [--compile]

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


class Block(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.fc_out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)), self.dropout, self.training)
        return x + F.dropout(self.fc_out(F.gelu(self.fc(self.ln_2(x)))), self.dropout, self.training)


class ReferenceGPT(nn.Module):
    def __init__(self, layers, hidden, heads, seq, vocab, dropout):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f, self.dropout = nn.LayerNorm(hidden), dropout
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
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    return parser.parse_args()


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
    model = ReferenceGPT(args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
                         args.vocab_size, args.dropout).cuda()
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
        num_query_groups=args.num_attention_heads, swiglu=False, ffn_hidden_size=4 * args.hidden_size,
        recompute_granularity=None, global_batch_size=args.global_batch_size)
    tflops = training_flops_per_iteration(flops_args, args.vocab_size) / seconds / world / 1e12
    if int(os.environ.get("RANK", "0")) == 0:
        name = f"{'compiled' if args.compile else 'eager'}{f' DDP x{world}' if world > 1 else ''}"
        print(f"reference {name}: {seconds * 1000:.1f} ms/iteration {tflops:.1f} TFLOP/s peak memory (MB): "
              f"{torch.cuda.max_memory_allocated() / 2**20:.0f}", flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
