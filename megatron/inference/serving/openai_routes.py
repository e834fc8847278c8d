"""The OpenAI-compatible routes of the REST server (same port, same process as ``PUT /api``): ``GET /v1/models``,
``POST /v1/completions`` and ``POST /v1/chat/completions``, whole answers or server-sent events ending in
``data: [DONE]``. Requests go through the server's own checks, limits and engine (docs/openai_api.md)."""

from __future__ import annotations

import logging
import queue
import time
from http import HTTPStatus

from megatron.inference.engine import NonFiniteLogits
from megatron.inference.errors import ProtocolError
from megatron.inference.prompts import sampling_fields
from megatron.inference.requests import load_json
from megatron.inference.service import Job, ServerLost, pick_seed
from megatron.inference.serving.openai_answers import (
    ChoiceText,
    answer_header,
    chat_answer,
    chat_logprobs,
    completion_answer,
    completion_logprobs,
    finish_reason,
    usage,
)
from megatron.inference.serving.openai_errors import error_body, from_protocol_error
from megatron.inference.serving.openai_requests import OpenAIRequest, parse_chat, parse_completion
from megatron.inference.serving.request_body import BodyRefused, read_body

log = logging.getLogger("megatron.inference.openai")

# route -> (parse the body, shape the whole answer, the stream chunks' object)
ROUTES = {"/v1/completions": (parse_completion, completion_answer, "text_completion"),
          "/v1/chat/completions": (parse_chat, chat_answer, "chat.completion.chunk")}


def get(handler) -> None:
    """``GET /v1/models`` and ``GET /v1/models/<name>``: the one model this server serves."""
    name = handler.server.model_name
    model = {"id": name, "object": "model", "created": handler.server.started, "owned_by": "megatronapp"}
    path = handler.path.split("?", 1)[0].rstrip("/")
    if path == "/v1/models":
        return handler._reply(HTTPStatus.OK, {"object": "list", "data": [model]})
    if path == f"/v1/models/{name}":
        return handler._reply(HTTPStatus.OK, model)
    if path.startswith("/v1/models/"):
        return handler._reply(HTTPStatus.NOT_FOUND, error_body(
            HTTPStatus.NOT_FOUND, f"no model {path[11:71]!r} here; this server serves {name!r}", "model",
            "model_not_found"))
    return handler._reply(HTTPStatus.NOT_FOUND, error_body(
        HTTPStatus.NOT_FOUND, f"no route GET {path[:60]}; this server has GET /v1/models", None, "not_found"))


def post(handler) -> None:
    """``POST /v1/...``: an OpenAI-shaped answer or error, whatever the client sent."""
    path = handler.path.split("?", 1)[0].rstrip("/")
    if path not in ROUTES:
        return handler._reply(HTTPStatus.NOT_FOUND, error_body(
            HTTPStatus.NOT_FOUND, f"no route POST {path[:60]}; this server has POST /v1/completions and "
            "POST /v1/chat/completions", None, "not_found"))
    parse, shape, chunk_kind = ROUTES[path]
    chat = path == "/v1/chat/completions"
    try:
        body = read_body(handler.headers, handler.rfile, handler.server.max_body_bytes)
    except BodyRefused as refused:
        handler.close_connection = True  # the body, unread, cannot be told from a next request
        return handler._reply(refused.status, error_body(refused.status, str(refused)))
    try:
        parsed = parse(load_json(body or b"null", "body"))
        if parsed.model != handler.server.model_name:
            raise ProtocolError("model_not_found", f"model {parsed.model[:60]!r} is not served here; this server "
                                f"serves {handler.server.model_name!r} (GET /v1/models)", "model")
        prompts = handler.server.encoder.encode(parsed.request)
        seed = pick_seed(parsed.request["random_seed"])
        payload = {"kind": "generate", "prompts": prompts, "params": sampling_fields(parsed.request, seed),
                   "streamed": parsed.stream}
        handler.job = job = Job(payload=payload, requester_gone=lambda: handler.peer_gone())
        if parsed.stream:
            return _stream(handler, job, parsed, chunk_kind)
        generation = handler.server.service.run(job)
    except ProtocolError as error:
        return handler._reply(*from_protocol_error(error, chat))
    except NonFiniteLogits as error:  # the model, as perturbed, cannot answer this request
        return handler._reply(HTTPStatus.UNPROCESSABLE_ENTITY, error_body(
            HTTPStatus.UNPROCESSABLE_ENTITY, str(error), None, "non_finite_logits"))
    except ServerLost as error:  # rank 0 ends with the death's line: this answer says it in one line
        return handler._reply(HTTPStatus.INTERNAL_SERVER_ERROR, error_body(HTTPStatus.INTERNAL_SERVER_ERROR,
                                                                           str(error)))
    except Exception:  # noqa: BLE001  a server failure: logged, answered, the server goes on
        log.exception("generation failed")
        return handler._reply(HTTPStatus.INTERNAL_SERVER_ERROR, error_body(
            HTTPStatus.INTERNAL_SERVER_ERROR, "generation failed; see the server log"))
    if job.requester_gone():
        handler.close_connection = True
        return None
    return handler._reply(HTTPStatus.OK, shape(generation, handler.server.encoder, parsed))


def _chunk(header: dict, chat: bool, index: int, text: str, logprobs, reason: str | None) -> dict:
    choice = {"index": index, "delta": {"content": text}} if chat else {"index": index, "text": text}
    return {**header, "choices": [{**choice, "logprobs": logprobs, "finish_reason": reason}]}


def _stream(handler, job: Job, parsed: OpenAIRequest, chunk_kind: str) -> None:
    """Submit ``job`` and answer with its tokens as server-sent events while they come."""
    service, encoder = handler.server.service, handler.server.encoder
    events: queue.Queue = queue.Queue()
    job.stream = events.put
    job.add_done_callback(lambda _: events.put(None))
    service.submit(job, refuse_if_busy=False)  # ProtocolError("busy") before anything is sent
    chat = chunk_kind.startswith("chat")
    header = answer_header(chunk_kind, parsed.model)
    rows = len(job.payload["prompts"])
    texts = [ChoiceText(encoder.tokenizer, parsed.stop) for _ in range(rows)]
    handler.start_events()
    if chat:  # OpenAI's first chunk of each choice names the role
        for row in range(rows):
            handler.send_event({**header, "choices": [{"index": row, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]})
    while (event := events.get()) is not None:
        row, token, logprob, best = event.row, event.token, event.logprob, event.best
        text = texts[row]
        if text.stopped:
            continue
        text.add([token])
        logprobs = None
        if parsed.logprobs is not None:
            pairs = [best] if parsed.logprobs else None
            logprobs = (chat_logprobs if chat else completion_logprobs)(encoder, [token], [logprob], pairs)
        handler.send_event(_chunk(header, chat, row, text.delta(final=False), logprobs,
                                  "stop" if text.stopped else None))
        if all(text.stopped for text in texts):
            job.cancel()  # every choice has met a stop string: the rest would be cut
    if job.error is not None:
        message = str(job.error) if isinstance(job.error, (ProtocolError, NonFiniteLogits, ServerLost)) else \
            "generation failed; see the server log"
        handler.send_event(error_body(HTTPStatus.INTERNAL_SERVER_ERROR, message))
    else:
        for row, text in enumerate(texts):
            if not text.stopped:
                handler.send_event(_chunk(header, chat, row, text.delta(final=True), None,
                                          finish_reason(job.result.finish_reasons[row], text)))
        if parsed.include_usage:
            prompt_tokens = sum(map(len, job.payload["prompts"][::parsed.n]))
            handler.send_event({**header, "choices": [], "usage": usage(prompt_tokens,
                                                                        sum(text.kept for text in texts))})
    handler.send_event("[DONE]")


def server_fields(server, model_name: str, max_body_bytes: int) -> None:
    """What the routes read from the HTTP server besides its service and encoder."""
    server.model_name, server.max_body_bytes, server.started = model_name, max_body_bytes, int(time.time())

