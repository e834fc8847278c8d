"""Per-token host time of our generation engine against transformers' generate, side by side, on CPU.

    python bench/generation_host_overhead.py               # tiny Llama on CPU, one thread: ms/token, both
    python bench/generation_host_overhead.py --profile     # and a cProfile of ours (top functions)

A tiny Llama-shaped model (hidden 64, 16 layers as Llama-3.2-1B, GQA 4/2) makes the model math negligible on one
CPU thread, so the time per token is the host's (Python, dispatch): what bounds a small-batch decode step on a GPU.
The random weights are created here, converted by tools/checkpoint/convert.py, and both generators run greedy
on the same weights in one process, alternately, and report their best of a few rounds. Times are the
thread's CPU time (one thread does all the work), so other processes sharing the cores barely move them.
"""

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PROMPT = list(range(100, 132))  # token ids
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)


def worker(hf_dir, new_tokens, rounds, profile, flags):
    import torch
    from transformers import AutoModelForCausalLM

    import pretrain_gpt
    from megatron.inference.engine import GenerationEngine
    from megatron.inference.model_setup import setup_for_generation
    from megatron.inference.sampling import SamplingParams

    torch.set_num_threads(1)
    args, model, tokenizer = setup_for_generation(flags, "generation_host_overhead.py", pretrain_gpt.model_provider)
    engine = GenerationEngine(model, tokenizer.vocab_size, tokenizer.eod, args.max_position_embeddings, "cpu")
    params = SamplingParams(top_k=1, tokens_to_generate=new_tokens)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([PROMPT])

    def ours():
        return engine.generate([PROMPT], params).tokens[0][len(PROMPT):]

    def theirs():
        with torch.no_grad():
            output = hf.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0)
        return output[0, len(PROMPT):].tolist()

    best = {"ours": float("inf"), "transformers": float("inf")}
    tokens = {}
    for _ in range(rounds + 1):  # the first round warms up both
        for name, function in (("ours", ours), ("transformers", theirs)):
            start = time.thread_time()
            tokens[name] = function()
            best[name] = min(best[name], (time.thread_time() - start) / new_tokens)
    row = {name: seconds * 1000 for name, seconds in best.items()}
    row["same tokens"] = tokens["ours"] == tokens["transformers"]
    if profile:
        profiler = cProfile.Profile()
        profiler.runcall(ours)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    print("RESULT " + json.dumps(row), flush=True)


def _make_llama(directory, shape):
    """Random Llama weights and a word-level tokenizer (w0 .. w{vocab-1}) saved as a Hugging Face folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(**shape, architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(shape["vocab_size"])}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "w2"}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up (best is kept)")
    parser.add_argument("--layers", type=int, default=16, help="layers of the tiny model (16: Llama-3.2-1B's)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one generation of ours")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options, flags = parser.parse_known_args()
    if options.worker:
        return worker(options.worker, options.new_tokens, options.rounds, options.profile,
                      [flag for flag in flags if flag != "--"])
    from megatron.training.ports import free_port

    with tempfile.TemporaryDirectory() as work:
        hf_dir, converted = os.path.join(work, "hf"), os.path.join(work, "megatron")
        _make_llama(hf_dir, dict(LLAMA_TINY, num_hidden_layers=options.layers))
        subprocess.run([sys.executable, os.path.join(REPO, "tools/checkpoint/convert.py"), "--model-type", "GPT",
                        "--loader", "llama_mistral", "--saver", "core", "--checkpoint-type", "hf", "--load-dir",
                        hf_dir, "--save-dir", converted], cwd=REPO, check=True, capture_output=True)
        with open(os.path.join(converted, "model_args.txt")) as f:
            flags = f.read().split() + ["--seq-length", "256", "--device", "cpu"]
        env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
        command = [sys.executable, os.path.abspath(__file__), "--worker", hf_dir, "--new-tokens",
                   str(options.new_tokens), "--rounds", str(options.rounds)] + \
            (["--profile"] if options.profile else []) + ["--", *flags]
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if options.profile:
        print(result.stdout[-60000:])
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        sys.exit(f"worker failed (exit {result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    row = json.loads(lines[-1][len("RESULT "):])
    print(f"tiny Llama ({options.layers} layers), CPU, 1 thread, batch 1, {len(PROMPT)}-token prompt, "
          f"{options.new_tokens} new tokens, greedy")
    print(f"ours {row['ours']:.2f} ms/token, transformers generate {row['transformers']:.2f} ms/token, "
          f"ratio {row['ours'] / row['transformers']:.2f}, same tokens: {row['same tokens']}")


if __name__ == "__main__":
    main()
