"""The generation server under load: tokens/s, requests/s, latency and errors as clients grow.

    python bench/serve_load.py                        # GPU: the GPT 1.3B and Llama-3-8B shapes, random weights
    python bench/serve_load.py --models 8b --clients 1 64
    python bench/serve_load.py --tiny                 # CPU check of the same code, a tiny model (~1 min)

Per model, ``tools/run_text_generation_server.py`` runs on one process (one GPU); for each count of concurrent
clients, each client sends its share of the requests one after another on its own connection:
- generation: ``POST /v1/completions``, a 32-token prompt, ``max_tokens`` greedy tokens (64 on GPU), one request per
  client;
- scoring: ``echo`` + ``logprobs`` with ``max_tokens`` 0 (what lm-evaluation-harness sends), ``--scoring-requests``
  in all, shared among the clients.
Printed per row: total tokens/s (generated tokens over the wall time), requests/s, p50 and p99 latency, and the
requests that got no answer (connection errors) or an error status. The server batches up to ``--slots`` prompts
(``--inference-max-requests``); ``--one-at-a-time`` also runs each model with one slot, the reference that the
batch is measured against (requests take turns, as before continuous batching). A warm-up at the largest client
count first captures the decode step's CUDA graphs of every batch size it will meet.
"""

import argparse
import concurrent.futures
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PROMPT = " ".join(str(token) for token in range(100, 132))
_SHAPE = ["--tokenizer-type", "NullTokenizer", "--max-position-embeddings", "4096", "--seq-length", "4096", "--bf16"]
_LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base", "500000",
          "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention"]
MODELS = {
    "1.3b": ("GPT 1.3B shape", ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
                                "--vocab-size", "50257", *_SHAPE]),
    "8b": ("Llama-3-8B shape", ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
                                "--num-attention-heads", "32", "--num-query-groups", "8", "--vocab-size", "128256",
                                *_LLAMA, *_SHAPE]),
}
TINY = ("tiny", ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "512",
                 "--tokenizer-type", "NullTokenizer", "--max-position-embeddings", "128", "--seq-length", "128",
                 "--device", "cpu", "--use-cpu-initialization"])


class Server:
    """The server on one process, started and stopped by this bench."""

    def __init__(self, flags, slots):
        # 512 positions a slot hold the bench's prompts and tokens: the KV cache of 64 slots stays small.
        length = min(512, int(flags[flags.index("--max-position-embeddings") + 1]))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                   os.path.join(REPO, "tools/run_text_generation_server.py"), *flags, "--port", "0",
                   "--max-prompts", "16", "--inference-max-requests", str(slots),
                   "--inference-max-seq-length", str(length)]
        self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        self.lines = []
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("server pid "):
                break
        else:
            sys.exit("the server did not start:\n" + "".join(self.lines[-30:]))
        self.url = re.search(r"REST API on (http://\S+)/api", "".join(self.lines)).group(1)
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=60)


def _post(url, body):
    """(seconds, generated tokens, None) of one request, or (seconds, 0, what went wrong)."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=3600) as answer:
            usage = json.loads(answer.read())["usage"]
        return time.perf_counter() - start, usage["completion_tokens"], None
    except urllib.error.HTTPError as error:
        return time.perf_counter() - start, 0, f"status {error.code}"
    except OSError as error:  # a connection refused or reset: the request was lost
        return time.perf_counter() - start, 0, type(error).__name__


def load(url, clients, requests, body):
    """One row: ``requests`` requests of ``body`` from ``clients`` concurrent clients."""
    shares = [requests // clients + (1 if client < requests % clients else 0) for client in range(clients)]

    def client(share):
        return [_post(url, body) for _ in range(share)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [result for part in pool.map(client, shares) for result in part]
    wall = time.perf_counter() - start
    latencies = sorted(seconds for seconds, _, _ in results)
    errors = [error for _, _, error in results if error]
    return {"clients": clients, "requests": len(results), "tokens/s": sum(tokens for _, tokens, _ in results) / wall,
            "requests/s": len(results) / wall, "p50 s": statistics.median(latencies),
            "p99 s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "errors": f"{len(errors)} ({', '.join(sorted(set(errors)))})" if errors else "0"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the benchmark itself")
    parser.add_argument("--models", default="1.3b,8b", help="comma-separated, of: " + ", ".join(MODELS))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per generation (64; 8 tiny)")
    parser.add_argument("--scoring-requests", type=int, default=None, help="scoring requests per row (1000; 64 tiny)")
    parser.add_argument("--slots", type=int, default=64, help="prompts the server batches (--inference-max-requests)")
    parser.add_argument("--one-at-a-time", action="store_true", help="each model with one slot too, as a reference")
    options = parser.parse_args()
    unknown = set(options.models.split(",")) - set(MODELS)
    if unknown and not options.tiny:
        parser.error(f"--models: unknown {', '.join(sorted(unknown))}; choose from {', '.join(MODELS)}")
    max_tokens = options.max_tokens or (8 if options.tiny else 64)
    scoring = options.scoring_requests or (64 if options.tiny else 1000)
    models = [TINY] if options.tiny else [MODELS[key] for key in options.models.split(",")]
    generate = {"model": "megatron", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    score = {"model": "megatron", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    for name, flags in models:
        for slots in [options.slots, 1] if options.one_at_a_time else [options.slots]:
            server = Server(flags, slots)
            try:
                top = max(options.clients)
                load(server.url, top, top, generate)  # warm-up: every batch size's graph captured
                rows = [("generation", load(server.url, clients, clients, generate)) for clients in options.clients]
                rows += [("scoring", load(server.url, clients, max(scoring, clients), score))
                         for clients in options.clients]
            finally:
                server.stop()
            print(f"{name}: one process, {slots} slot(s), {max_tokens} greedy tokens per generation, a 32-token prompt")
            columns = ["clients", "requests", "tokens/s", "requests/s", "p50 s", "p99 s", "errors"]
            print(f"  {'kind':>10} " + " ".join(f"{column:>12}" for column in columns))
            for kind, row in rows:
                print(f"  {kind:>10} " + " ".join(f"{row[c]:>12.2f}" if isinstance(row[c], float) else
                                                  f"{row[c]:>12}" for c in columns))


if __name__ == "__main__":
    main()
