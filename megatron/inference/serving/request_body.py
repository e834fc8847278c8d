"""A REST request's body as bytes, whether its size comes first (Content-Length) or it arrives in chunks.

Clients that stream a body, or do not know its size up front (``curl -T -``, ``requests`` given a generator,
HTTP/1.1 proxies), send ``Transfer-Encoding: chunked`` and no Content-Length. http.server does not decode it:
read by Content-Length alone, such a body read as empty and was refused as "not a JSON object". A body over
the limit, or one malformed, is refused before it is read whole; the connection is then closed, since the
unread rest cannot be told from a next request.
"""

import re
from http import HTTPStatus

_BYTE_COUNT = re.compile(r"[0-9]+")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?\r?\n")
_MAX_LINE_BYTES = 8192  # a chunk-size line or a trailer: what http.server allows a header line


class BodyRefused(Exception):
    """The body cannot be read: ``status`` and the message to answer with; the connection must be closed."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


def _read_chunked(rfile, limit: int) -> bytes:
    """RFC 9112 section 7.1: ``size[;extension]`` lines, each followed by that many bytes and CRLF, up to a
    size 0, then optional trailer lines and an empty line."""
    body = bytearray()
    while True:
        line = rfile.readline(_MAX_LINE_BYTES + 1)
        match = _CHUNK_SIZE.fullmatch(line)
        if match is None:
            raise BodyRefused(HTTPStatus.BAD_REQUEST, f"a chunked body's chunk size must be hexadecimal digits, "
                                                      f"not {line[:40]!r}")
        size = int(match.group(1), 16)
        if size == 0:
            break
        if len(body) + size > limit:
            raise BodyRefused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is over {limit} bytes")
        chunk = rfile.read(size)
        if len(chunk) != size or rfile.readline(3) not in (b"\r\n", b"\n"):
            raise BodyRefused(HTTPStatus.BAD_REQUEST, "a chunked body's chunk is shorter than its size")
        body += chunk
    while (trailer := rfile.readline(_MAX_LINE_BYTES + 1)) not in (b"\r\n", b"\n", b""):
        if len(trailer) > _MAX_LINE_BYTES:
            raise BodyRefused(HTTPStatus.BAD_REQUEST, "a chunked body's trailer line is too long")
    return bytes(body)


def read_body(headers, rfile, limit: int) -> bytes:
    """The request's body (``headers``: the request's, ``rfile``: its stream), at most ``limit`` bytes.
    Transfer-Encoding, when present, decides the length (RFC 9112 section 6.3): Content-Length is then ignored."""
    encoding = headers.get("Transfer-Encoding")
    if encoding is not None:
        if encoding.strip().lower() != "chunked":
            raise BodyRefused(HTTPStatus.NOT_IMPLEMENTED, f"Transfer-Encoding {encoding[:40]!r} is not supported; "
                                                          f"send the body with Content-Length or chunked")
        return _read_chunked(rfile, limit)
    length = headers.get("Content-Length") or "0"
    if not _BYTE_COUNT.fullmatch(length):
        raise BodyRefused(HTTPStatus.BAD_REQUEST, f"Content-Length must be the body's size in bytes, "
                                                  f"not {length[:40]!r}")
    # (its digits first: int() refuses thousands of them with a ValueError)
    if len(length) > len(str(limit)) or int(length) > limit:
        raise BodyRefused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is over {limit} bytes")
    return rfile.read(int(length))
