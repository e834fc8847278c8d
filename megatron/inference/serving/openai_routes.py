"""The OpenAI-compatible routes of the REST server (same port, same process as ``PUT /api``): ``GET /v1/models``,
``POST /v1/completions`` and ``POST /v1/chat/completions``, whole answers or server-sent events ending in
``data: [DONE]``. Requests go through the server's own checks, limits and engine (docs/openai_api.md)."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from aiohttp import web

from megatron.inference.engine import NonFiniteLogits
from megatron.inference.errors import ProtocolError
from megatron.inference.jobs import Job
from megatron.inference.prompts import sampling_fields
from megatron.inference.service import ServerLost, pick_seed
from megatron.inference.serving.answering import generation_route, submit
from megatron.inference.serving.context import ROUTE_CONTEXT
from megatron.inference.serving.loop_jobs import SubmittedJob
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
from megatron.inference.serving.request_body import BodyTooLarge, json_body

log = logging.getLogger("megatron.inference.openai")

# route -> (parse the body, shape the whole answer, the stream chunks' object)
ROUTES = {"/v1/completions": (parse_completion, completion_answer, "text_completion"),
          "/v1/chat/completions": (parse_chat, chat_answer, "chat.completion.chunk")}


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param, code), status=status)


async def get(request: web.Request) -> web.Response:
    """``GET /v1/models`` and ``GET /v1/models/<name>``: the one model this server serves."""
    context = request.app[ROUTE_CONTEXT]
    name = context.model_name
    model = {"id": name, "object": "model", "created": context.started, "owned_by": "megatronapp"}
    path = request.path.rstrip("/")
    if path == "/v1/models":
        return web.json_response({"object": "list", "data": [model]})
    if path == f"/v1/models/{name}":
        return web.json_response(model)
    if path.startswith("/v1/models/"):
        return _error(HTTPStatus.NOT_FOUND, f"no model {path[11:71]!r} here; this server serves {name!r}", "model",
                      "model_not_found")
    return _error(HTTPStatus.NOT_FOUND, f"no route GET {path[:60]}; this server has GET /v1/models", None, "not_found")


@generation_route
async def post(request: web.Request) -> web.StreamResponse:
    """``POST /v1/...``: an OpenAI-shaped answer or error, whatever the client sent."""
    path = request.path.rstrip("/")
    if path not in ROUTES:
        return _error(HTTPStatus.NOT_FOUND, f"no route POST {path[:60]}; this server has POST /v1/completions and "
                      "POST /v1/chat/completions", None, "not_found")
    parse, shape, chunk_kind = ROUTES[path]
    chat = path == "/v1/chat/completions"
    context = request.app[ROUTE_CONTEXT]
    try:
        parsed = parse(await json_body(request))
        if parsed.model != context.model_name:
            raise ProtocolError("model_not_found", f"model {parsed.model[:60]!r} is not served here; this server "
                                f"serves {context.model_name!r} (GET /v1/models)", "model")
        prompts = context.encoder.encode(parsed.request)
        seed = pick_seed(parsed.request["random_seed"])
        payload = {"kind": "generate", "prompts": prompts, "params": sampling_fields(parsed.request, seed),
                   "streamed": parsed.stream}
        submitted = submit(request, Job(payload=payload), streamed=parsed.stream)  # "busy" before anything is sent
        if not parsed.stream:
            generation = await submitted.result()
    except BodyTooLarge as refused:
        return _error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(refused))
    except ProtocolError as error:
        status, error_json = from_protocol_error(error, chat)
        return web.json_response(error_json, status=status)
    except NonFiniteLogits as error:  # the model, as perturbed, cannot answer this request
        return _error(HTTPStatus.UNPROCESSABLE_ENTITY, str(error), None, "non_finite_logits")
    except ServerLost as error:  # rank 0 ends with the death's line: this answer says it in one line
        return _error(HTTPStatus.INTERNAL_SERVER_ERROR, str(error))
    except Exception:  # noqa: BLE001  a server failure: logged, answered, the server goes on
        log.exception("generation failed")
        return _error(HTTPStatus.INTERNAL_SERVER_ERROR, "generation failed; see the server log")
    if parsed.stream:
        return await _stream(request, submitted, parsed, chunk_kind)
    return web.json_response(shape(generation, context.encoder, parsed))


def _chunk(header: dict, chat: bool, index: int, text: str, logprobs: dict | None, reason: str | None) -> dict:
    choice = {"index": index, "delta": {"content": text}} if chat else {"index": index, "text": text}
    return {**header, "choices": [{**choice, "logprobs": logprobs, "finish_reason": reason}]}


async def _send_event(response: web.StreamResponse, data: dict | str) -> None:
    """One ``data:`` event: a JSON object, or the text ``[DONE]``."""
    await response.write(b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n")


async def _stream(request: web.Request, submitted: SubmittedJob, parsed: OpenAIRequest,
                  chunk_kind: str) -> web.StreamResponse:
    """Answer with the submitted job's tokens as server-sent events while they come."""
    encoder, job = request.app[ROUTE_CONTEXT].encoder, submitted.job
    chat = chunk_kind.startswith("chat")
    header = answer_header(chunk_kind, parsed.model)
    rows = len(job.payload["prompts"])
    texts = [ChoiceText(encoder.tokenizer, parsed.stop) for _ in range(rows)]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    if chat:  # OpenAI's first chunk of each choice names the role
        for row in range(rows):
            await _send_event(response, {**header, "choices": [{"index": row, "delta": {"role": "assistant",
                                                                                        "content": ""},
                                                                "logprobs": None, "finish_reason": None}]})
    async for event in submitted.tokens():
        text = texts[event.row]
        if text.stopped:
            continue
        text.add([event.token])
        logprobs = None
        if parsed.logprobs is not None:
            pairs = [event.best] if parsed.logprobs else None
            logprobs = (chat_logprobs if chat else completion_logprobs)(encoder, [event.token], [event.logprob], pairs)
        await _send_event(response, _chunk(header, chat, event.row, text.delta(final=False), logprobs,
                                           "stop" if text.stopped else None))
        if all(text.stopped for text in texts):
            job.cancel()  # every choice has met a stop string: the rest would be cut
    if job.error is not None:
        message = str(job.error) if isinstance(job.error, (ProtocolError, NonFiniteLogits, ServerLost)) else \
            "generation failed; see the server log"
        await _send_event(response, error_body(HTTPStatus.INTERNAL_SERVER_ERROR, message))
    else:
        generation = job.result
        assert generation is not None, "a generation that ended without an error has its result"
        for row, text in enumerate(texts):
            if not text.stopped:
                await _send_event(response, _chunk(header, chat, row, text.delta(final=True), None,
                                                   finish_reason(generation.finish_reasons[row], text)))
        if parsed.include_usage:
            prompt_tokens = sum(map(len, job.payload["prompts"][::parsed.n]))
            await _send_event(response, {**header, "choices": [], "usage": usage(prompt_tokens,
                                                                                 sum(text.kept for text in texts))})
    await _send_event(response, "[DONE]")
    return response
