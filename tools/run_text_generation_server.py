"""Megatron-LM's text generation server on our models, with MegaScope's WebSocket.

    torchrun --nproc_per_node N tools/run_text_generation_server.py <model flags> --load CKPT \\
        --tokenizer-type ... [--port 5000] [--enable-ws-server [--ws-host 127.0.0.1] [--ws-port 5001] [--ws-token T]]

Every rank runs the model at its TP/PP (DP replicas share a REST request's prompts); rank 0 serves the REST API
(PUT /api), the OpenAI-compatible routes on the same port (/v1/completions, /v1/chat/completions, /v1/models:
docs/openai_api.md) and, with --enable-ws-server, the WebSocket of docs/megascope_protocol.md.
Without --load the model keeps its seeded initialization. SIGINT or SIGTERM (Ctrl-C; torchrun passes the
signal on to every rank) stops every rank after the step in progress: "server stopped", exit code 0.
"""

import megatron.training  # noqa: F401  first: quiets megatron-core's import notices; ends with its launcher

# isort: split
import functools
import logging
import os
import signal
import sys
import threading

import torch

import pretrain_gpt
from megascope.inference_session import InferenceSession, ScopeObserver, apply_perturbations
from megascope.ws_server import WebSocketServer
from megatron.inference.engine import GenerationEngine
from megatron.inference.limits import Limits
from megatron.inference.model_setup import setup_for_generation
from megatron.inference.prompts import PromptEncoder, load_chat_template
from megatron.inference.service import GenerationService
from megatron.inference.serving.app import serve_rest
from megatron.training.errors import ArgumentError, UserError, exit_on_user_error
from megatron.training.initialize import shutdown
from megatron.training.peer_watch import now_doing

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

PAGE_BUILD = os.path.join(REPO, "tools", "visualization", "transformer-visualize", "dist")


def _server_args(parser):
    g = parser.add_argument_group("text generation server")
    g.add_argument("--port", type=int, default=5000, help="REST API port (PUT /api)")
    g.add_argument("--host", default="127.0.0.1", help="REST API host")
    g.add_argument("--served-model-name", default=None, help="the model's name on the OpenAI-compatible routes "
                   "(/v1/models; a request's \"model\"); default: --load's folder name, else megatron")
    g.add_argument("--enable-ws-server", action="store_true", help="serve MegaScope's WebSocket too")
    g.add_argument("--ws-host", default="127.0.0.1", help="any other host than 127.0.0.1/localhost/::1 needs a token")
    g.add_argument("--ws-port", type=int, default=5001)
    g.add_argument("--ws-token", default=None, help="token clients send in hello (generated and printed when "
                   "--ws-host is not local and none is given)")
    g.add_argument("--ws-allowed-origins", default="", help="comma-separated page origins allowed besides "
                   "localhost ones, e.g. https://scope.example:8443")
    g.add_argument("--ws-max-message-bytes", type=int, default=Limits.max_message_bytes)
    g.add_argument("--ws-max-messages-per-second", type=int, default=Limits.max_messages_per_second)
    g.add_argument("--ws-send-queue-frames", type=int, default=Limits.send_queue_frames)
    g.add_argument("--max-tokens-to-generate", type=int, default=Limits.max_tokens_to_generate)
    g.add_argument("--max-prompts", type=int, default=Limits.max_prompts,
                   help="prompts per request, REST and WebSocket alike (Megatron-LM's REST server took 128)")
    g.add_argument("--inference-max-requests", type=int, default=32,
                   help="prompts generated at once (the KV cache's slots): concurrent REST requests share one batch "
                   "of this many rows, the others wait; 1 serves one prompt at a time")
    g.add_argument("--inference-max-seq-length", type=int, default=None,
                   help="positions of each slot, prompt and new tokens (default: --max-position-embeddings); the KV "
                   "cache holds --inference-max-requests x this many positions per layer")
    g.add_argument("--inference-max-prefill-tokens", type=int, default=512,
                   help="prompt tokens a batch step reads beside its decoding rows; a longer prompt is read in chunks "
                   "over several steps, so running requests wait at most that long for a new one")


def _check(args):
    if args.sequence_parallel:
        raise ArgumentError("--sequence-parallel: generation reads one token per step, which cannot be split over "
                            "the sequence; leave it out")
    for flag in ("port", "ws_port"):
        if not 0 <= getattr(args, flag) <= 65535:
            raise ArgumentError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: a port is 0..65535")
    for flag in ("ws_max_message_bytes", "ws_max_messages_per_second", "ws_send_queue_frames",
                 "max_tokens_to_generate", "max_prompts", "inference_max_requests", "inference_max_prefill_tokens"):
        if getattr(args, flag) < 1:
            raise ArgumentError(f"--{flag.replace('_', '-')} must be at least 1")
    model_length = args.max_position_embeddings or args.seq_length
    if args.inference_max_seq_length is not None and not 2 <= args.inference_max_seq_length <= model_length:
        raise ArgumentError(f"--inference-max-seq-length {args.inference_max_seq_length}: must be 2..{model_length} "
                            f"(the model's --max-position-embeddings)")


def _start_websocket(args, service, encoder, model, limits):
    session = InferenceSession(service, encoder, model, args, limits)
    origins = [origin.strip() for origin in args.ws_allowed_origins.split(",") if origin.strip()]
    session.server = WebSocketServer(session, args.ws_host, args.ws_port, args.ws_token, limits, origins).start()
    print(f"MegaScope WebSocket on ws://{args.ws_host}:{session.server.port}", flush=True)
    return session.server


def _observer_factory(args, model):
    def build(payload):
        if "scope" not in payload:
            return None
        return ScopeObserver(payload["scope"], model, args)
    return build


def _apply_control(args, model, payload):
    if "perturbations" in payload:
        apply_perturbations(model, args, payload["perturbations"])


def _stop_on_signals(service):
    """SIGINT/SIGTERM on rank 0: stop the service, whose stop job ends every rank's loop."""
    def stop(signum, frame):
        # From a thread: the handler runs on the main thread, which may hold the job queue's lock.
        threading.Thread(target=service.stop, name="stop", daemon=True).start()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)


def _leave_signals_to_rank_0():
    """The other ranks ignore SIGINT/SIGTERM from the start (torchrun signals every rank, maybe while one
    still sets up): they must not leave a collective half done, and rank 0's stop ends their loop."""
    if int(os.environ.get("RANK", "0")) != 0:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)


def _served_model_name(args):
    if args.served_model_name:
        return args.served_model_name
    return os.path.basename(os.path.normpath(args.load)) if args.load else "megatron"


def _listen(args, service, tokenizer, model, max_length):
    """Rank 0: the REST server and, with --enable-ws-server, the WebSocket one, listening; UserError (one line)
    when a port cannot be bound."""
    limits = Limits(max_message_bytes=args.ws_max_message_bytes,
                    max_messages_per_second=args.ws_max_messages_per_second,
                    send_queue_frames=args.ws_send_queue_frames, max_prompts=args.max_prompts,
                    # a prompt holds a token at least: the model's length bounds what a welcome may promise
                    max_tokens_to_generate=min(args.max_tokens_to_generate, max_length - 1))
    encoder = PromptEncoder(tokenizer, load_chat_template(args), max_length, limits)
    model_name = _served_model_name(args)
    try:
        rest = serve_rest(service, encoder, args.host, args.port, PAGE_BUILD, model_name)
    except OSError as error:
        raise UserError(f"--port {args.port}: cannot listen on {args.host}:{args.port} ({error.strerror}); "
                        "pick a free port") from None
    print(f"REST API on http://{args.host}:{rest.port}/api (PUT)", flush=True)
    print(f"OpenAI-compatible API on http://{args.host}:{rest.port}/v1 (model {model_name})", flush=True)
    websocket = _start_websocket(args, service, encoder, model, limits) if args.enable_ws_server else None
    return rest, websocket


@exit_on_user_error
def main():
    _leave_signals_to_rank_0()
    args, model, tokenizer = setup_for_generation(sys.argv[1:], "run_text_generation_server.py",
                                                  pretrain_gpt.model_provider, extra_args_provider=_server_args,
                                                  check_args=_check)
    max_length = args.inference_max_seq_length or args.max_position_embeddings or args.seq_length
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    engine = GenerationEngine(model, tokenizer.vocab_size, tokenizer.eod, max_length, device,
                              slots=args.inference_max_requests)
    service = GenerationService(engine, device, _observer_factory(args, model),
                                functools.partial(_apply_control, args, model),
                                prefill_tokens=args.inference_max_prefill_tokens)
    rank = torch.distributed.get_rank()
    rest = websocket = None
    # Every rank has its model before rank 0 says it listens: "server pid" means the whole server is up.
    torch.distributed.barrier()
    if rank == 0:
        _stop_on_signals(service)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        logging.getLogger("websockets.server").setLevel(logging.WARNING)  # our own lines say where it listens
        try:
            rest, websocket = _listen(args, service, tokenizer, model, max_length)
        except UserError:
            # The other ranks already wait in the service's loop for rank 0's first job: the stop job ends it, so
            # they exit quietly, where they saw rank 0 vanish from their broadcast and printed gloo's trace.
            service.stop()
            service.serve_forever(rank)
            raise
        print(f"server pid {os.getpid()}: Ctrl-C or kill -INT {os.getpid()} stops every rank", flush=True)
    now_doing("serving requests")
    service.serve_forever(rank)
    if rest is not None:  # rank 0: close the listening sockets and the clients' connections
        rest.stop()
    if websocket is not None:
        websocket.stop()
    shutdown()
    if rank == 0:
        print("server stopped", flush=True)


if __name__ == "__main__":
    main()
