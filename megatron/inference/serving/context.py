"""What every route of the HTTP server serves with, kept in its aiohttp application (``request.app[ROUTE_CONTEXT]``)."""

import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from megatron.inference.prompts import PromptEncoder
from megatron.inference.service import GenerationService


@dataclass(frozen=True)
class RouteContext:
    """The service that runs generations, the prompt encoder, the model's name on the OpenAI-compatible routes, and
    the page build's folder (None: there is none)."""
    service: GenerationService
    encoder: PromptEncoder
    model_name: str
    static_root: Path | None
    started: int = field(default_factory=lambda: int(time.time()))  # /v1/models' "created"


ROUTE_CONTEXT = web.AppKey("route_context", RouteContext)
