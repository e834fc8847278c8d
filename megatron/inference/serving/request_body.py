"""A request's JSON body, at most ``MAX_BODY_BYTES``: aiohttp reads it whether its size comes first (Content-Length)
or it arrives in chunks (Transfer-Encoding: chunked), and answers a body it cannot parse (a bad size or chunk) with a
400 itself; a body over the limit is the route's to refuse (413, in its own error shape)."""

from typing import Any

from aiohttp import web

from megatron.inference.requests import load_json

MAX_BODY_BYTES = 1 << 20  # the application's client_max_size


class BodyTooLarge(Exception):
    """The body is over the limit; the message says so."""


async def _read_body(request: web.Request) -> bytes:
    """The whole body; BodyTooLarge past the application's ``client_max_size``. A size announced over the limit is
    refused before any of it is read (aiohttp then reads and drops what the client still sends)."""
    limit = request.client_max_size
    too_large = BodyTooLarge(f"the body is over {limit} bytes")
    if (request.content_length or 0) > limit:
        raise too_large
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None


async def json_body(request: web.Request) -> Any:
    """The body's JSON value (an empty body is null); BodyTooLarge, or ProtocolError("bad_json") saying why not."""
    return load_json(await _read_body(request) or b"null", "body")
