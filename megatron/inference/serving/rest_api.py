"""Megatron-LM's REST API on rank 0: ``PUT /api`` generates; other GET paths serve the MegaScope page's build
(tools/visualization/transformer-visualize/dist) when it exists; any other method is refused. The OpenAI-compatible
routes under ``/v1/`` (openai_routes.py, docs/openai_api.md) share the port and the service. See
docs/megascope_protocol.md ("REST API")."""

from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web

from megatron.inference.engine import Generation, NonFiniteLogits
from megatron.inference.errors import ProtocolError
from megatron.inference.jobs import Job
from megatron.inference.prompts import PromptEncoder, sampling_fields
from megatron.inference.requests import parse_rest_request
from megatron.inference.service import ServerLost, pick_seed
from megatron.inference.serving.answering import generation_route, submit
from megatron.inference.serving.context import ROUTE_CONTEXT
from megatron.inference.serving.request_body import BodyTooLarge, json_body

log = logging.getLogger("megatron.inference.rest")


def rest_answer(generation: Generation, encoder: PromptEncoder, seed: int, with_logprobs: bool) -> dict:
    """Megatron-LM's answer: full texts, per-token segments and ids, log-probabilities when asked."""
    answer = {"text": [encoder.tokenizer.detokenize(tokens) for tokens in generation.tokens],
              "segments": [[encoder.token_text(token) for token in tokens] for tokens in generation.tokens],
              "tokens": generation.tokens, "finish_reason": generation.finish_reasons, "random_seed": seed}
    if with_logprobs:
        answer["logprobs"] = generation.logprobs
    return answer


def refusal(status: int, message: str, field: str | None = None) -> web.Response:
    """The REST API's error answer: {"error": message} (prefixed by the field, and {"field"}, when there is one)."""
    body = {"error": f"{field}: {message}" if field else message}
    if field:
        body["field"] = field
    return web.json_response(body, status=status)


@generation_route
async def generate(request: web.Request) -> web.Response:
    """``PUT /api``: Megatron-LM's generation request."""
    if request.path.rstrip("/") != "/api":
        return refusal(HTTPStatus.NOT_FOUND, "PUT /api generates; nothing else takes PUT")
    context = request.app[ROUTE_CONTEXT]
    try:
        checked = parse_rest_request(await json_body(request))
        prompts = context.encoder.encode(checked)
        seed = pick_seed(checked["random_seed"])
        job = Job(payload={"kind": "generate", "prompts": prompts, "params": sampling_fields(checked, seed)})
        generation = await submit(request, job).result()
    except BodyTooLarge as refused:
        return refusal(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(refused))
    except ProtocolError as error:
        status = HTTPStatus.SERVICE_UNAVAILABLE if error.code == "busy" else HTTPStatus.BAD_REQUEST
        return refusal(status, error.message, error.field)
    except NonFiniteLogits as error:  # the model, as perturbed, cannot answer this request
        return refusal(HTTPStatus.UNPROCESSABLE_ENTITY, str(error))
    except ServerLost as error:  # rank 0 ends with the death's line: this answer says it in one line
        return refusal(HTTPStatus.INTERNAL_SERVER_ERROR, str(error))
    except Exception:  # noqa: BLE001  a server failure: logged, answered, the server goes on
        log.exception("generation failed")
        return refusal(HTTPStatus.INTERNAL_SERVER_ERROR, "generation failed; see the server log")
    return web.json_response(rest_answer(generation, context.encoder, seed, checked["logprobs"]))


async def page_file(request: web.Request) -> web.StreamResponse:
    """``GET /PATH``: a file of the page's build (``/``: its index.html); ``GET /api`` is refused (PUT only)."""
    if request.path.rstrip("/") == "/api":
        return await method_not_allowed(request)
    root = request.app[ROUTE_CONTEXT].static_root
    if root is None:
        return refusal(HTTPStatus.NOT_FOUND, "no page build here (tools/visualization/transformer-visualize/dist); "
                       "use PUT /api or the WebSocket")
    relative = request.path.lstrip("/") or "index.html"
    path = (root / relative).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        return refusal(HTTPStatus.NOT_FOUND, f"no file {relative}")
    return web.FileResponse(path)


async def method_not_allowed(request: web.Request) -> web.Response:
    """Any method but PUT (and GET, POST where they serve)."""
    return refusal(HTTPStatus.METHOD_NOT_ALLOWED, "use PUT /api")
