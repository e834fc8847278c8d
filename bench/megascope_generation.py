"""MegaScope generation benchmark: one table, within one 10-minute GPU call.

    python bench/megascope_generation.py            # GPU: GPT 345M and a random Llama-shaped model, bf16
    python bench/megascope_generation.py --tiny     # CPU check of the same code, tiny shapes (~1-2 min)

For each model, greedy generation of NEW tokens after a 32-token prompt (batch 1, one process):
  tokens/s with capture off (the default path: static KV cache, CUDA-graphed decode), the same without CUDA graphs
  and on megatron-core's inference path (with how many greedy tokens agree), with the WebSocket server on and idle,
  and with a full capture (every hook at every layer, raw values, logit lens) streamed to a real WebSocket client;
  bytes per generated token on the wire (binary data frames + JSON) against the same content as JSON text; for the
  Llama model, transformers' generate on the same random weights (created here, converted by
  tools/checkpoint/convert.py).
Each model runs in a worker process of its own (one megatron initialisation per process).
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

PROMPT = list(range(100, 132))
ALL_HOOKS = ["embed", "ln1", "attn.q", "attn.k", "attn.v", "attn.pattern", "attn.out", "resid_mid", "mlp.pre",
             "mlp.out", "resid_post", "final_norm", "logits"]
GPT_345M = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
            "--max-position-embeddings", "1024", "--bf16"]
GPT_TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--use-cpu-initialization"]
GPT_TOKENIZER = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(REPO, "datasets/gpt/vocab.json"),
                 "--merge-file", os.path.join(REPO, "datasets/gpt/merges.txt")]
# Llama-3.2-1B-like (untied, GQA 32/8, vocabulary of 32000 word tokens) and a tiny one for the CPU check.
LLAMA = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, rope_theta=500000.0,
             tie_word_embeddings=False)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)


# ---------------------------------------------------------------- worker: one model, every measurement
def _synchronize():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(function):
    _synchronize()
    start = time.perf_counter()
    result = function()
    _synchronize()
    return result, time.perf_counter() - start


def _generated(generation):
    return sum(len(tokens) - length for tokens, length in zip(generation.tokens, generation.prompt_lengths))


def _json_size(frame):
    """Bytes of one data frame's content written as JSON text (header fields and a nested list of numbers)."""
    from megascope.wire import decode_data_frame
    header, values = decode_data_frame(frame)
    return len(json.dumps({**header, "values": values.tolist()}).encode())


async def _capture_client(url, new_tokens):
    """Generate with a full capture; (seconds, generated tokens, wire bytes, the same content as JSON bytes)."""
    from websockets.asyncio.client import connect
    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "hello", "protocol": 1}))
        await ws.recv()
        capture = {"hooks": ALL_HOOKS, "reduction": "none", "logit_lens": True, "topk": 5}
        start = time.perf_counter()
        await ws.send(json.dumps({"type": "generate", "prompts": [" ".join(["the"] * len(PROMPT))],
                                  "tokens_to_generate": new_tokens, "top_k": 1, "capture": capture}))
        text_bytes, frames = 0, []
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                frames.append(message)
                continue
            text_bytes += len(message.encode())
            reply = json.loads(message)
            if reply["type"] == "error":
                raise RuntimeError(reply["message"])
            if reply["type"] == "generation_done":
                seconds = time.perf_counter() - start
                break
    generated = sum(len(tokens) for tokens in reply["tokens"])
    binary = sum(map(len, frames))
    # JSON text of every frame would take minutes to write in Python: measured on an even sample of them.
    sample = frames[::max(1, len(frames) // 500)]
    json_per_binary_byte = sum(map(_json_size, sample)) / max(1, sum(map(len, sample)))
    return seconds, generated, text_bytes + binary, text_bytes + binary * json_per_binary_byte


def _hf_tokens_per_second(hf_dir, new_tokens, device):
    import torch
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=dtype).to(device).eval()
    prompt = torch.tensor([PROMPT], device=device)

    def generate():
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0)
    generate()  # warm-up
    output, seconds = _timed(generate)
    return (output.shape[1] - len(PROMPT)) / seconds


def worker(kind, flags, new_tokens, hf_dir):
    import torch

    import pretrain_gpt
    from megascope.inference_session import InferenceSession
    from megascope.ws_server import WebSocketServer
    from megatron.inference.engine import GenerationEngine
    from megatron.inference.limits import Limits
    from megatron.inference.model_setup import setup_for_generation
    from megatron.inference.prompts import PromptEncoder
    from megatron.inference.sampling import SamplingParams
    from megatron.inference.service import GenerationService

    args, model, tokenizer = setup_for_generation(flags, "megascope_generation.py", pretrain_gpt.model_provider)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    engine = GenerationEngine(model, tokenizer.vocab_size, tokenizer.eod, args.max_position_embeddings, device)
    # Stop tokens none but the end-of-document token; random weights rarely pick it: counts are measured.
    params = SamplingParams(top_k=1, tokens_to_generate=new_tokens)
    engine.generate([PROMPT], params)  # warm-up
    row = {"model": kind}
    generation, seconds = _timed(lambda: engine.generate([PROMPT], params))
    row["capture off"] = _generated(generation) / seconds
    # The same generation on the static cache without CUDA graphs, and on megatron-core's inference path.
    for column, variant in {"no CUDA graphs": dict(cuda_graphs=False), "megatron-core path": dict(static_cache=False)
                            }.items():
        other = GenerationEngine(model, tokenizer.vocab_size, tokenizer.eod, args.max_position_embeddings, device,
                                 **variant)
        other.generate([PROMPT], params)  # warm-up
        theirs, seconds = _timed(lambda other=other: other.generate([PROMPT], params))
        row[column] = _generated(theirs) / seconds
        # bf16 rounding differs between the paths, so a near tie may flip a greedy token: report where they part.
        same = [a == b for a, b in zip(generation.tokens[0], theirs.tokens[0])] + [False]
        row[f"tokens equal to {column}"] = f"{same.index(False) - len(PROMPT)}/{_generated(generation)}"

    limits = Limits(send_queue_frames=1_000_000, max_tokens_to_generate=new_tokens)
    service = GenerationService(engine, device)
    encoder = PromptEncoder(tokenizer, None, args.max_position_embeddings, limits)
    session = InferenceSession(service, encoder, model, args, limits)
    session.server = WebSocketServer(session, "127.0.0.1", 0, limits=limits).start()
    generation, seconds = _timed(lambda: engine.generate([PROMPT], params))
    row["ws idle"] = _generated(generation) / seconds

    url = f"ws://127.0.0.1:{session.server.port}"
    measured = []

    def client():
        try:
            asyncio.run(_capture_client(url, 2))  # warm-up of the capture path
            measured.append(asyncio.run(_capture_client(url, new_tokens)))
        finally:
            service.stop()
    # The model loop stays on the main thread, as in the server (the CPU stand-ins for CUDA are per thread).
    threading.Thread(target=client, daemon=True).start()
    service.serve_forever(0)
    session.server.stop()
    if not measured:
        sys.exit("the full-capture client failed; see above")
    seconds, generated, wire, as_json = measured[0]
    row["full capture"] = generated / seconds
    row["wire bytes/token"] = wire / generated
    row["as JSON bytes/token"] = as_json / generated
    if hf_dir:
        row["transformers"] = _hf_tokens_per_second(hf_dir, new_tokens, args.device)
    print("RESULT " + json.dumps(row), flush=True)


# ---------------------------------------------------------------- parent: models, workers, the table
def _make_llama(directory, shape):
    """Random Llama weights and a word-level tokenizer (w0 .. w{vocab-1}) saved as a Hugging Face folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(**shape, architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(shape["vocab_size"])}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "w2"}, f)


def _run_worker(kind, flags, new_tokens, hf_dir=None):
    from megatron.training.ports import free_port

    command = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--new-tokens", str(new_tokens),
               "--hf-dir", hf_dir or "", "--", *flags]
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        sys.exit(f"{kind} worker failed (exit {result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: checks the benchmark itself")
    parser.add_argument("--new-tokens", type=int, default=None, help="generated tokens (128 on GPU, 16 tiny)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    options, flags = parser.parse_known_args()
    if options.worker:
        return worker(options.worker, [flag for flag in flags if flag != "--"], options.new_tokens,
                      options.hf_dir or None)
    new_tokens = options.new_tokens or (16 if options.tiny else 128)
    device = ["--device", "cpu"] if options.tiny else ["--device", "cuda"]
    gpt = (GPT_TINY if options.tiny else GPT_345M) + GPT_TOKENIZER + device
    rows = [_run_worker("GPT 345M" if not options.tiny else "GPT tiny", gpt, new_tokens)]
    with tempfile.TemporaryDirectory() as work:
        hf_dir, converted = os.path.join(work, "hf"), os.path.join(work, "megatron")
        _make_llama(hf_dir, LLAMA_TINY if options.tiny else LLAMA)
        subprocess.run([sys.executable, os.path.join(REPO, "tools/checkpoint/convert.py"), "--model-type", "GPT",
                        "--loader", "llama_mistral", "--saver", "core", "--checkpoint-type", "hf", "--load-dir",
                        hf_dir, "--save-dir", converted] + ([] if options.tiny else ["--bf16"]),
                       cwd=REPO, check=True, capture_output=True)
        with open(os.path.join(converted, "model_args.txt")) as f:
            llama_flags = f.read().split() + ["--seq-length", "1024"] + device + ([] if options.tiny else ["--bf16"])
        name = "Llama tiny" if options.tiny else "Llama 1B-shaped"
        rows.append(_run_worker(name, llama_flags, new_tokens, hf_dir))
    columns = ["model", "capture off", "no CUDA graphs", "megatron-core path", "ws idle", "full capture",
               "transformers", "wire bytes/token", "as JSON bytes/token", "tokens equal to no CUDA graphs",
               "tokens equal to megatron-core path"]
    print(f"greedy generation, batch 1, 32-token prompt, {new_tokens} new tokens; tokens/s unless named bytes")
    print(" | ".join(f"{column:>19}" for column in columns))
    for row in rows:
        print(" | ".join(f"{row[c]:>19.1f}" if isinstance(row.get(c), float) else f"{row.get(c, '-'):>19}"
                         for c in columns))


if __name__ == "__main__":
    main()
