"""The one error type of the generation servers: a client's request cannot be served as sent.

The REST API answers it with an HTTP error ({"error", "field"}); MegaScope's WebSocket with an error frame
{"type": "error", "code", "message", "field"}; both go on serving.
"""


class ProtocolError(Exception):
    """A request that cannot be served as sent: `code` (e.g. "bad_field", "busy"), a one-sentence `message`,
    and the offending `field` when there is one."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
