"""OpenAI-shaped error answers of the OpenAI-compatible routes (docs/openai_api.md, "Errors"):
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status OpenAI's clients map to their exception
classes (400 BadRequestError, 404 NotFoundError, 413, 422 UnprocessableEntityError, 503 InternalServerError)."""

from http import HTTPStatus

from megatron.inference.errors import ProtocolError

# The server's own field names (megatron/inference/requests.py) -> the OpenAI request's, so that an error from the
# shared checks (limits, prompt encoding) names the field the client sent.
OPENAI_NAMES = {"prompts": "prompt", "tokens_to_generate": "max_tokens", "random_seed": "seed",
                "stop_tokens": "stop"}

# ProtocolError codes -> (status, OpenAI's code)
_STATUS = {"busy": (HTTPStatus.SERVICE_UNAVAILABLE, "server_busy"),
           "too_large": (HTTPStatus.BAD_REQUEST, "context_length_exceeded"),
           "bad_json": (HTTPStatus.BAD_REQUEST, "invalid_json"),
           "not_found": (HTTPStatus.NOT_FOUND, "not_found"),
           "model_not_found": (HTTPStatus.NOT_FOUND, "model_not_found")}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The answer's JSON: client errors are "invalid_request_error", the server's own "server_error"."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_protocol_error(error: ProtocolError, chat: bool) -> tuple[int, dict]:
    """(status, body) for a request refused by the server's checks, its field named as the client sent it."""
    status, code = _STATUS.get(error.code, (HTTPStatus.BAD_REQUEST, "invalid_value"))
    param, message = error.field, error.message
    if param in OPENAI_NAMES or (chat and param in ("prompts", "chat")):
        renamed = "messages" if chat and param in ("prompts", "chat") else OPENAI_NAMES[param]
        message = message.replace(param, renamed)
        param = renamed
    return status, error_body(status, message, param, code)
