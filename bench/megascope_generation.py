"""What MegaScope costs a generation: one table, side by side in one process per model.

    python bench/megascope_generation.py                 # GPU: Llama-1B and Llama-3-8B shapes, bf16, random weights
    python bench/megascope_generation.py --models 8b     # one of them
    python bench/megascope_generation.py --tiny          # CPU check of the same code, a tiny shape (~1 min)

Per model, batch 1, greedy, NEW tokens after a 32-token prompt, every figure in tokens/s of one timed generation
after a warm-up one: ``PUT /api`` on the server's REST door; the same over MegaScope's WebSocket with capture off; with
the norm of ``resid_post`` at every layer; with the attention pattern (mean over heads) and the logit lens top-5 at
every layer; with every hook raw at every layer. The clients run in a process of their own; each WebSocket client reads
every frame and counts the ones the server dropped. ``ws MB/s`` is what the WebSocket moves when it only sends: the
full capture's frames sent again from a session that has no model, to the same kind of client, so the full capture's
rate can be read against it.
``max rel diff``: per hook, the largest difference, relative to the frame's largest value, between a full capture on
the static cache (CUDA graphs) and the same capture on megatron-core's eager path (asked for with attribution), over
16 tokens.
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PROMPT = " ".join(str(token) for token in range(100, 132))
ALL_HOOKS = ["embed", "ln1", "attn.q", "attn.k", "attn.v", "attn.pattern", "attn.out", "resid_mid", "mlp.post",
             "mlp.out", "resid_post", "final_norm", "logits"]
CAPTURES = {
    "resid norm": {"hooks": ["resid_post"], "reduction": "norm"},
    "pattern + lens": {"hooks": ["attn.pattern"], "reduction": "mean_heads", "logit_lens": True, "topk": 5},
    "full capture": {"hooks": ALL_HOOKS, "reduction": "none", "logit_lens": True, "topk": 5},
}
_LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base", "500000",
          "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention",
          "--tokenizer-type", "NullTokenizer", "--max-position-embeddings", "4096", "--seq-length", "4096"]
MODELS = {
    "1b": ("Llama-1B shape", ["--num-layers", "16", "--hidden-size", "2048", "--ffn-hidden-size", "8192",
                              "--num-attention-heads", "32", "--num-query-groups", "8", "--vocab-size", "32000",
                              "--bf16", *_LLAMA]),
    "8b": ("Llama-3-8B shape", ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
                                "--num-attention-heads", "32", "--num-query-groups", "8", "--vocab-size", "128256",
                                "--bf16", *_LLAMA]),
}
TINY = ("tiny", ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads",
                 "4", "--num-query-groups", "2", "--vocab-size", "512", "--use-cpu-initialization", "--device", "cpu",
                 *_LLAMA])


# ---------------------------------------------------------------- clients
def _put(url, new_tokens):
    body = json.dumps({"prompts": [PROMPT], "tokens_to_generate": new_tokens, "top_k": 1}).encode()
    request = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        tokens = json.loads(answer.read())["tokens"][0]
    return (len(tokens) - 32) / (time.perf_counter() - start)


async def _ws_generation(url, new_tokens, capture):
    """(tokens/s, the frames, dropped frames, generation_done) of one generation whose every frame is read."""
    from websockets.asyncio.client import connect
    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "hello", "protocol": 1}))
        await ws.recv()
        start = time.perf_counter()
        await ws.send(json.dumps({"type": "generate", "prompts": [PROMPT], "tokens_to_generate": new_tokens,
                                  "top_k": 1, "capture": capture}))
        frames, dropped = [], 0
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                frames.append(message)
                continue
            reply = json.loads(message)
            if reply["type"] == "error":
                raise RuntimeError(reply["message"])
            dropped += reply.get("frames", 0) if reply["type"] == "dropped" else 0
            if reply["type"] == "generation_done":
                seconds = time.perf_counter() - start
                return sum(map(len, reply["tokens"])) / seconds, frames, dropped, reply


def _ws(url, new_tokens, capture):
    return asyncio.run(_ws_generation(url, new_tokens, capture))


async def _byte_rate(url):
    """MB/s of the frames a ReplaySession sends back."""
    from websockets.asyncio.client import connect
    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "hello", "protocol": 1}))
        await ws.recv()
        start, received = time.perf_counter(), 0
        await ws.send(json.dumps({"type": "ping"}))
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                received += len(message)
            elif json.loads(message)["type"] == "replayed":
                return received / (time.perf_counter() - start) / 1e6


class ReplaySession:
    """A WebSocket session without a model: on the first ping it sends ``frames`` as the inference session's
    stream thread does (waiting for room, never dropping), then a ``replayed`` message."""
    mode = "inference"

    def __init__(self, frames):
        self.frames = frames

    def welcome_info(self):
        return {"model": {}, "hooks": [], "reductions": [], "noise": []}

    def on_welcome(self, client):
        threading.Thread(target=self._replay, args=(client,), daemon=True).start()

    def _replay(self, client):
        for frame in self.frames:
            client.wait_for_room(60)
            client.send_data(frame)
        client.send({"type": "replayed"})

    def on_message(self, client, message):
        pass

    def on_disconnect(self, client):
        pass


def _max_rel_diff(frames, reference):
    """{hook: largest difference relative to the frame's largest value} over the frames both runs sent, and how many
    of the reference's frames (but attribution) the other run lacks."""
    import numpy as np

    from megascope.wire import decode_data_frame

    def by_key(frame_list):
        decoded = (decode_data_frame(frame) for frame in frame_list)
        return {(h["hook"], h["prompt_index"], tuple(h["tokens"])): v for h, v in decoded}
    ours, theirs = by_key(frames), by_key(reference)
    worst = {}
    for key in ours.keys() & theirs.keys():
        a, b = ours[key].astype(np.float64), theirs[key].astype(np.float64)
        hook = key[0].split(".", 2)[-1] if key[0].startswith("blocks.") else key[0]
        worst[hook] = max(worst.get(hook, 0.0), float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
    missing = len(theirs.keys() - ours.keys() - {k for k in theirs if k[0] == "attribution"})
    return worst, missing


def _measure(put_url, ws_url, new_tokens, frames_file):
    """A client process (it shares no interpreter with the model loop): every generation's figures."""
    row = {}
    _put(put_url, new_tokens)  # warm-up: the plain graph at this length
    row["PUT /api"] = _put(put_url, new_tokens)
    for column, capture in {"capture off": None, **CAPTURES}.items():
        _ws(ws_url, new_tokens, capture)  # warm-up: the capture's graph at this length
        rate, frames, dropped, _ = _ws(ws_url, new_tokens, capture)
        row[column], row[f"{column} dropped"] = rate, dropped
    row["full MB/token"] = sum(map(len, frames)) / new_tokens / 1e6
    with open(frames_file, "wb") as f:
        pickle.dump(frames, f)
    _, graphed, _, done = _ws(ws_url, 16, CAPTURES["full capture"])
    _, eager, _, eager_done = _ws(ws_url, 16, {**CAPTURES["full capture"], "attribution": True})
    row["max rel diff"], row["frames missing"] = _max_rel_diff(graphed, eager)
    row["tokens equal"] = done["tokens"] == eager_done["tokens"]
    return row


def _in_a_process(function, *args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


# ---------------------------------------------------------------- worker: one model, every measurement
def worker(name, flags, new_tokens):
    import logging

    import torch

    import pretrain_gpt
    from megascope.inference_session import InferenceSession
    from megascope.ws_server import WebSocketServer
    from megatron.inference.engine import GenerationEngine
    from megatron.inference.limits import Limits
    from megatron.inference.model_setup import setup_for_generation
    from megatron.inference.prompts import PromptEncoder
    from megatron.inference.service import GenerationService
    from megatron.inference.serving.app import serve_rest

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the graphs' build times
    args, model, tokenizer = setup_for_generation(flags, "megascope_generation.py", pretrain_gpt.model_provider)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    engine = GenerationEngine(model, tokenizer.vocab_size, tokenizer.eod, args.max_position_embeddings, device)
    limits = Limits(max_tokens_to_generate=max(new_tokens, 16))  # the server's own send queue
    service = GenerationService(engine, device)
    encoder = PromptEncoder(tokenizer, None, args.max_position_embeddings, limits)
    session = InferenceSession(service, encoder, model, args, limits)
    session.server = WebSocketServer(session, "127.0.0.1", 0, limits=limits).start()
    rest = serve_rest(service, encoder, "127.0.0.1", 0, None)
    row = {"model": name}

    def client():
        try:
            with tempfile.TemporaryDirectory() as work:
                frames_file = os.path.join(work, "frames.pickle")
                row.update(_in_a_process(_measure, f"http://127.0.0.1:{rest.port}/api",
                                         f"ws://127.0.0.1:{session.server.port}", new_tokens, frames_file))
                with open(frames_file, "rb") as f:
                    replay = WebSocketServer(ReplaySession(pickle.load(f)), "127.0.0.1", 0, limits=limits).start()
            row["ws MB/s"] = _in_a_process(_byte_rate_of, f"ws://127.0.0.1:{replay.port}")
            replay.stop()
            row["full capture MB/s"] = row["full MB/token"] * row["full capture"]
        finally:
            service.stop()
    # The model loop stays on the main thread, as in the server.
    threading.Thread(target=client, daemon=True).start()
    service.serve_forever(0)
    session.server.stop()
    rest.stop()
    if "ws MB/s" not in row:
        sys.exit("a client failed; see above")
    print("RESULT " + json.dumps(row), flush=True)


def _byte_rate_of(url):
    return asyncio.run(_byte_rate(url))


# ---------------------------------------------------------------- parent: workers, the table
def _run_worker(name, flags, new_tokens):
    from megatron.training.ports import free_port

    command = [sys.executable, os.path.abspath(__file__), "--worker", name, "--new-tokens", str(new_tokens), "--",
               *flags]
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    sys.stderr.write("".join(line + "\n" for line in result.stderr.splitlines() if "captured the decode" in line))
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        sys.exit(f"{name} worker failed (exit {result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def ws_rate(frames, hidden):
    """MB/s of ``frames`` random float32 data frames of ``hidden`` values sent by a ReplaySession (no model)."""
    import numpy as np

    from megascope.wire import encode_data_frame
    from megascope.ws_server import WebSocketServer
    generator = np.random.default_rng(0)
    replayed = [encode_data_frame({"id": "g", "step": i, "hook": "blocks.0.ln1", "layer": 0, "prompt_index": 0,
                                   "tokens": [i, i + 1], "dims": ["token", "hidden"], "reduction": "none"},
                                  generator.standard_normal((1, hidden), dtype=np.float32), dtype="float32")
                for i in range(frames)]
    server = WebSocketServer(ReplaySession(replayed), "127.0.0.1", 0).start()
    rate = _in_a_process(_byte_rate_of, f"ws://127.0.0.1:{server.port}")
    server.stop()
    print(f"{frames} frames of {len(replayed[0])} bytes: {rate:.1f} MB/s, {rate * 1e6 / len(replayed[0]):.0f} frames/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on CPU: checks the benchmark itself")
    parser.add_argument("--ws-rate", action="store_true",
                        help="only the WebSocket's rate: 20,000 random float32 frames of 4096 values, no model")
    parser.add_argument("--models", default="1b,8b", help="comma-separated, of: " + ", ".join(MODELS))
    parser.add_argument("--new-tokens", type=int, default=None, help="generated tokens (128 on GPU, 16 tiny)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options, flags = parser.parse_known_args()
    if options.worker:
        return worker(options.worker, [flag for flag in flags if flag != "--"], options.new_tokens)
    if options.ws_rate:
        return ws_rate(20_000, 4096)
    new_tokens = options.new_tokens or (16 if options.tiny else 128)
    unknown = set(options.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {', '.join(sorted(unknown))}; choose from {', '.join(MODELS)}")
    models = [TINY] if options.tiny else [MODELS[key] for key in options.models.split(",")]
    rows = [_run_worker(name, flags, new_tokens) for name, flags in models]
    columns = ["model", "PUT /api", "capture off", "resid norm", "pattern + lens", "full capture", "full MB/token",
               "full capture MB/s", "ws MB/s", "capture off dropped", "resid norm dropped", "pattern + lens dropped",
               "full capture dropped", "max rel diff", "frames missing", "tokens equal"]
    print(f"greedy generation, batch 1, 32-token prompt, {new_tokens} new tokens; tokens/s unless named")
    for row in rows:
        plain = row["PUT /api"]
        for column in columns:
            value = row.get(column, "-")
            ratio = f" ({value / plain:.2f}x)" if column in ("capture off", *CAPTURES) else ""
            print(f"  {column:>22}: {value:.1f}{ratio}" if isinstance(value, float) else f"  {column:>22}: {value}")


if __name__ == "__main__":
    main()
