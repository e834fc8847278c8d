"""Convert random Llama 3 models of a tiny and of a real shape, time it, and check the converted model
against transformers: logits of a batch of prompts (fp32 on both sides) and greedy tokens.

    python bench/convert_llama_gpu.py RESULTS_DIR [--shapes tiny,llama3-8b-4l] [--device cuda|cpu]

For each shape: a random model (no download: weights drawn on --device) saved as sharded bf16
safetensors with a word-level tokenizer (w0 .. wN, one token a word); tools/checkpoint/convert.py
--bf16 (wall time, its per-shard GB and GB/s, its peak host memory above its imports beside the
largest shard plus the largest layer); generate_greedy.py on the checkpoint in fp32 (the bf16
weights upcast, as transformers does with them); transformers in fp32 on the same prompts.
Writes RESULTS_DIR/<shape>.json, the logs, and summary.txt (also printed).
Models go to a temporary directory removed at the end.
"""

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES = {
    "tiny": dict(config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=300, max_position_embeddings=16384),
                 shard="100KB"),
    # Llama 3(.1) 8B with 4 of its 32 layers: about 3.9 GB in bf16.
    "llama3-8b-4l": dict(config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                     max_position_embeddings=131072), shard="1GB"),
}
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 4, 32, 16
FP32_TOLERANCE = 1e-3  # max |ours - HF| / max |HF| over the prompts' logits, both in fp32
_SHARD_LINE = re.compile(r"shard \d+/\d+ \S+: \d+ tensors, [0-9.]+ GB in [0-9.]+ s")
_TENSORS_LINE = re.compile(r"read, converted and saved the tensors in ([0-9.]+) s")
_PEAK_LINE = re.compile(r"peak host memory: ([0-9.]+) GB, ([0-9.-]+) GB above")


def make_model(shape, directory, device):
    """A random bf16 Llama 3 of ``shape`` in ``directory`` with its tokenizer; returns random prompts' ids
    and the parameter count."""
    spec = SHAPES[shape]
    config = LlamaConfig(**spec["config"], rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(directory, max_shard_size=spec["shard"])
    params = sum(p.numel() for p in model.parameters())
    del model
    vocab = config.vocab_size
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "w2"}, f)
    ids = torch.randint(3, vocab, (PROMPTS, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    return ids, params


def run_logged(command, log_path, timeout):
    start = time.time()
    with open(log_path, "w") as log:
        result = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    with open(log_path) as log:
        output = log.read()
    if result.returncode:
        raise SystemExit(f"{' '.join(map(str, command[:4]))} ... failed (exit {result.returncode}); see {log_path}")
    return output, time.time() - start


def shard_and_layer_gb(hf_dir):
    """The largest safetensors shard plus the largest layer (as stored: bf16, the type converted to),
    the peak the conversion should stay near (above its imports)."""
    files = glob.glob(os.path.join(hf_dir, "*.safetensors"))
    layer_bytes = {}
    for path in files:
        with safe_open(path, framework="pt") as shard:
            for name in shard.keys():
                if name.startswith("model.layers."):
                    layer = int(name.split(".")[2])
                    layer_bytes[layer] = layer_bytes.get(layer, 0) + math.prod(shard.get_slice(name).get_shape()) * 2
    return (max(os.path.getsize(path) for path in files) + max(layer_bytes.values())) / 1e9


def convert(hf_dir, save_dir, log_path):
    output, wall = run_logged([sys.executable, "tools/checkpoint/convert.py", "--model-type", "GPT",
                               "--loader", "llama_mistral", "--saver", "core", "--checkpoint-type", "hf",
                               "--model-size", "llama3-8B", "--load-dir", hf_dir, "--save-dir", save_dir,
                               "--tokenizer-model", hf_dir, "--bf16"], log_path, timeout=420)
    if len(_SHARD_LINE.findall(output)) != len(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        raise SystemExit(f"{log_path}: not one progress line per shard")
    gigabytes = sum(os.path.getsize(path) for path in glob.glob(os.path.join(hf_dir, "*.safetensors"))) / 1e9
    tensor_seconds = float(_TENSORS_LINE.search(output).group(1))
    peak = _PEAK_LINE.search(output)
    return {"convert_wall_s": wall, "tensors_s": tensor_seconds, "gigabytes": gigabytes,
            "gb_per_s": gigabytes / max(tensor_seconds, 0.01), "peak_host_gb": float(peak.group(1)),
            "peak_above_imports_gb": float(peak.group(2)), "shard_plus_layer_gb": shard_and_layer_gb(hf_dir)}


def ours(save_dir, prompts_ids, work, device, log_path):
    """Our logits and greedy tokens, in fp32, at TP1/PP1 on one device."""
    prompts = os.path.join(work, "prompts.json")
    with open(prompts, "w") as f:
        json.dump([" ".join(f"w{i}" for i in row) for row in prompts_ids.tolist()], f)
    with open(os.path.join(save_dir, "model_args.txt")) as f:
        model_args = [flag for flag in f.read().split() if flag != "--bf16"]  # computed in fp32
    output = os.path.join(work, "ours.pt")
    run_logged([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                "tools/checkpoint/generate_greedy.py", *model_args, "--device", device,
                "--seq-length", str(PROMPT_TOKENS + NEW_TOKENS), "--prompts-json", prompts,
                "--max-new-tokens", str(NEW_TOKENS), "--output", output], log_path, timeout=300)
    return torch.load(output)


@torch.no_grad()
def hf_reference(hf_dir, prompts_ids, device):
    model = LlamaForCausalLM.from_pretrained(hf_dir).float().to(device).eval()  # bf16 upcast, exactly
    tokens = prompts_ids.to(device)
    logits = model(tokens).logits.float().cpu()
    margins = []  # top-1 minus top-2 logit at each generated step: a tie flips on rounding
    for _ in range(NEW_TOKENS):
        step = model(tokens).logits[:, -1].float()
        top = step.topk(2, dim=-1).values
        margins.append((top[:, 0] - top[:, 1]).min().item())
        tokens = torch.cat([tokens, step.argmax(-1, keepdim=True)], dim=1)
    return logits, tokens.cpu(), min(margins)


def check(shape, out_dir, work_root, device):
    work = os.path.join(work_root, shape)
    hf_dir, save_dir = os.path.join(work, "hf"), os.path.join(work, "megatron")
    start = time.time()
    prompts_ids, params = make_model(shape, hf_dir, device)
    result = {"shape": shape, "params": params, "make_s": time.time() - start,
              **convert(hf_dir, save_dir, os.path.join(out_dir, f"{shape}.convert.log"))}
    mine = ours(save_dir, prompts_ids, work, device, os.path.join(out_dir, f"{shape}.generate.log"))
    hf_logits, hf_tokens, smallest_margin = hf_reference(hf_dir, prompts_ids, device)
    relative = ((mine["logits"] - hf_logits).abs().max() / hf_logits.abs().max()).item()
    result.update(logits_max_rel_err_fp32=relative, tolerance=FP32_TOLERANCE,
                  logits_ok=relative < FP32_TOLERANCE, tokens_equal=torch.equal(mine["tokens"], hf_tokens),
                  smallest_top2_margin=smallest_margin)
    with open(os.path.join(out_dir, f"{shape}.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


def summary(results, device):
    header = (f"{'shape':<14} {'params':>10} {'HF GB':>7} {'convert s':>9} {'tensors s':>9} {'GB/s':>6} {'peak GB':>8} "
              f"{'above imports GB':>16} {'shard+layer GB':>14} {'logits rel err':>14} {'tol':>6} "
              f"{'tokens equal':>12} {'min top-2 gap':>13}")
    lines = [f"device: {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), "
             f"torch {torch.__version__}", header]
    for r in results:
        lines.append(f"{r['shape']:<14} {r['params']:>10,} {r['gigabytes']:>7.4f} {r['convert_wall_s']:>9.1f} "
                     f"{r['tensors_s']:>9.1f} "
                     f"{r['gb_per_s']:>6.3f} {r['peak_host_gb']:>8.3f} {r['peak_above_imports_gb']:>16.3f} "
                     f"{r['shard_plus_layer_gb']:>14.3f} "
                     f"{r['logits_max_rel_err_fp32']:>14.2e} {r['tolerance']:>6.0e} {str(r['tokens_equal']):>12} "
                     f"{r['smallest_top2_margin']:>13.2e}")
    verdict = all(r["logits_ok"] and r["tokens_equal"] for r in results)
    lines.append("PASS" if verdict else "FAIL (tokens that differ where the top-2 gap is below the logits' "
                                        "error are a rounding tie, not a conversion error)")
    return "\n".join(lines), verdict


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir")
    parser.add_argument("--shapes", default="tiny,llama3-8b-4l")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    options = parser.parse_args()
    shapes = options.shapes.split(",")
    unknown = [shape for shape in shapes if shape not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown[0]}; known: {', '.join(SHAPES)}")
    os.makedirs(options.results_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="convert_llama_") as work_root:
        results = [check(shape, options.results_dir, work_root, options.device) for shape in shapes]
    text, verdict = summary(results, options.device)
    with open(os.path.join(options.results_dir, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    sys.exit(0 if verdict else 1)


if __name__ == "__main__":
    main()
