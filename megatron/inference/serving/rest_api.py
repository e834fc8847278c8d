"""Megatron-LM's REST API on rank 0: ``PUT /api`` generates; the OpenAI-compatible routes under ``/v1/``
(megatron/inference/serving/openai_routes.py, docs/openai_api.md) generate through the same service; other GET paths
serve the MegaScope page's build (tools/visualization/transformer-visualize/dist) when it exists. See
docs/megascope_protocol.md."""

import json
import logging
import mimetypes
import select
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from megatron.inference.engine import NonFiniteLogits
from megatron.inference.errors import ProtocolError
from megatron.inference.prompts import sampling_fields
from megatron.inference.requests import load_json, parse_rest_request
from megatron.inference.service import Job, ServerLost, pick_seed
from megatron.inference.serving import openai_routes
from megatron.inference.serving.request_body import BodyRefused, read_body

log = logging.getLogger("megatron.inference.rest")
MAX_BODY_BYTES = 1 << 20


def peer_closed(connection: socket.socket) -> bool:
    """Whether the client at the other end of ``connection`` has closed it (or reset it): the socket reads
    as end of file. Its request's body has been read whole before generating, so nothing else is due; bytes
    it sent after (a pipelined request) mean it is still there."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and not connection.recv(1, socket.MSG_PEEK)
    except OSError:
        return True


def rest_answer(generation, encoder, seed, with_logprobs):
    """Megatron-LM's answer: full texts, per-token segments and ids, log-probabilities when asked."""
    answer = {"text": [encoder.tokenizer.detokenize(tokens) for tokens in generation.tokens],
              "segments": [[encoder.token_text(token) for token in tokens] for tokens in generation.tokens],
              "tokens": generation.tokens, "finish_reason": generation.finish_reasons, "random_seed": seed}
    if with_logprobs:
        answer["logprobs"] = generation.logprobs
    return answer


class RestHandler(BaseHTTPRequestHandler):
    server_version = "MegatronApp-generation"
    # set by serve_rest: service, encoder, static_root

    job = None  # the generation of the request being answered: told when its answer has gone (_answer)

    def log_message(self, format, *args):  # the default writes every request to stderr
        log.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status, body, content_type="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client left before its answer: nobody to tell
            log.info("%s went away before its %d answer", self.address_string(), status)
            self.close_connection = True

    def _answer(self, route):
        """Answer this request with ``route(self)``; the generation it ran (``self.job``) is told once its answer,
        whole or streamed, has gone: the end of a server that lost a rank waits for that (service.fail_unfinished)."""
        self.job = None  # a kept-alive connection's previous request's
        try:
            return route(self)
        finally:
            if self.job is not None:
                self.job.answered.set()

    def peer_gone(self):
        """Whether this request's client has left (closed its connection, or a write to it failed)."""
        return getattr(self, "_events_broken", False) or peer_closed(self.connection)

    def start_events(self):
        """Answer 200 with server-sent events (``send_event``); the connection closes after the last."""
        self.close_connection = True  # no Content-Length: the end of the stream is the end of the connection
        self._events_broken = False
        try:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
        except (BrokenPipeError, ConnectionResetError):
            self._events_broken = True

    def send_event(self, data):
        """One ``data:`` event (a JSON object, or the text ``[DONE]``); nothing once the client has left."""
        if self._events_broken:
            return
        try:
            self.wfile.write(b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            log.info("%s went away during its stream", self.address_string())
            self._events_broken = True

    def _refuse(self, status, message, field=None):
        body = {"error": f"{field}: {message}" if field else message}
        if field:
            body["field"] = field
        self._reply(status, body)

    def do_PUT(self):
        return self._answer(RestHandler._generate)

    def _generate(self):
        """``PUT /api``: Megatron-LM's generation request."""
        if self.path.rstrip("/") != "/api":
            return self._refuse(HTTPStatus.NOT_FOUND, "PUT /api generates; nothing else takes PUT")
        try:
            body = read_body(self.headers, self.rfile, MAX_BODY_BYTES)
        except BodyRefused as refused:
            self.close_connection = True  # the body, unread, cannot be told from a next request
            return self._refuse(refused.status, str(refused))
        try:
            request = parse_rest_request(load_json(body or b"null", "body"))
            prompts = self.server.encoder.encode(request)
            seed = pick_seed(request["random_seed"])
            payload = {"kind": "generate", "prompts": prompts, "params": sampling_fields(request, seed)}
            self.job = job = Job(payload=payload, requester_gone=lambda: peer_closed(self.connection))
            generation = self.server.service.run(job)
        except ProtocolError as error:
            status = HTTPStatus.SERVICE_UNAVAILABLE if error.code == "busy" else HTTPStatus.BAD_REQUEST
            return self._refuse(status, error.message, error.field)
        except NonFiniteLogits as error:  # the model, as perturbed, cannot answer this request
            return self._refuse(HTTPStatus.UNPROCESSABLE_ENTITY, str(error))
        except ServerLost as error:  # rank 0 ends with the death's line: this answer says it in one line
            return self._refuse(HTTPStatus.INTERNAL_SERVER_ERROR, str(error))
        except Exception:  # noqa: BLE001  a server failure: logged, answered, the server goes on
            log.exception("generation failed")
            return self._refuse(HTTPStatus.INTERNAL_SERVER_ERROR, "generation failed; see the server log")
        if job.requester_gone():
            generated = max(len(tokens) - prompt for tokens, prompt in zip(generation.tokens,
                                                                           generation.prompt_lengths))
            log.info("%s went away: its generation stopped after %d of %d tokens", self.address_string(),
                     generated, request["tokens_to_generate"])
            self.close_connection = True
            return None
        self._reply(HTTPStatus.OK, rest_answer(generation, self.server.encoder, seed, request["logprobs"]))

    def do_POST(self):
        if self.path.startswith("/v1/"):
            return self._answer(openai_routes.post)
        return self._method_not_allowed()

    def do_GET(self):
        if self.path.startswith("/v1/"):
            return openai_routes.get(self)
        if self.path.split("?", 1)[0].rstrip("/") == "/api":
            return self._method_not_allowed()  # the API takes PUT only
        root = self.server.static_root
        if root is None:
            return self._refuse(HTTPStatus.NOT_FOUND, "no page build here (tools/visualization/transformer-"
                                "visualize/dist); use PUT /api or the WebSocket")
        relative = self.path.split("?", 1)[0].lstrip("/") or "index.html"
        path = (root / relative).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            return self._refuse(HTTPStatus.NOT_FOUND, f"no file {relative}")
        self._reply(HTTPStatus.OK, path.read_bytes(), mimetypes.guess_type(path.name)[0] or "application/octet-stream")

    def _method_not_allowed(self):
        self._refuse(HTTPStatus.METHOD_NOT_ALLOWED, "use PUT /api")

    do_DELETE = do_PATCH = _method_not_allowed


class RestServer(ThreadingHTTPServer):
    # The standard library listens with a backlog of 5: a burst of clients beyond it had their connections reset
    # (18 of 64 at once on a CPU server). The kernel caps the backlog at its somaxconn.
    request_queue_size = 4096


def serve_rest(service, encoder, host, port, static_root, model_name="megatron"):
    """Start the REST server on a daemon thread; returns it (``server_address`` has the bound port).
    ``model_name``: the name the OpenAI-compatible routes serve the model under."""
    server = RestServer((host, port), RestHandler)
    server.daemon_threads = True
    server.service, server.encoder = service, encoder
    openai_routes.server_fields(server, model_name, MAX_BODY_BYTES)
    server.static_root = Path(static_root).resolve() if static_root and Path(static_root).is_dir() else None
    threading.Thread(target=server.serve_forever, name="rest-api", daemon=True).start()
    return server
