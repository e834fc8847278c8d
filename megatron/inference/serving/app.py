"""Rank 0's HTTP server: Megatron-LM's REST API, the OpenAI-compatible routes and the page's files on one port."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from megatron.inference.prompts import PromptEncoder
from megatron.inference.service import GenerationService
from megatron.inference.serving import openai_routes, rest_api
from megatron.inference.serving.context import ROUTE_CONTEXT, RouteContext
from megatron.inference.serving.http_server import HttpServer
from megatron.inference.serving.request_body import MAX_BODY_BYTES

# By method, then path: each route says itself what it answers a path it does not serve.
ROUTES = [web.put("/{path:.*}", rest_api.generate),
          web.post("/v1/{path:.*}", openai_routes.post),
          web.get("/v1/{path:.*}", openai_routes.get, allow_head=False),
          web.get("/{path:.*}", rest_api.page_file, allow_head=False),
          web.route("*", "/{path:.*}", rest_api.method_not_allowed)]


def serve_rest(service: GenerationService, encoder: PromptEncoder, host: str, port: int, static_root: str | None,
               model_name: str = "megatron") -> HttpServer:
    """Serve on ``host``:``port`` from a thread of its own (``.port``: the bound one; ``.stop()``); OSError when the
    port cannot be bound. ``static_root``: the page build's folder, served when it exists; ``model_name``: the
    model's name on the OpenAI-compatible routes."""
    root = Path(static_root).resolve() if static_root and Path(static_root).is_dir() else None
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ROUTE_CONTEXT] = RouteContext(service, encoder, model_name, root)
    app.add_routes(ROUTES)
    return HttpServer(app, host, port)
