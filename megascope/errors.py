"""The one error type of MegaScope: a client's request (capture spec, perturbation, message) is invalid.

Servers turn it into an error frame {"type": "error", "code", "message", "field"} and go on serving.
"""


class ProtocolError(Exception):
    """A request that cannot be served as sent: `code` (e.g. "bad_reduction"), a one-sentence `message`,
    and the offending `field` when there is one."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


def within(error, prefix):
    """``error`` with its field named inside ``prefix``: a capture spec's "topk" is the message's
    "capture.topk", the third perturbation's "scale" is "perturbations.2.scale"."""
    return ProtocolError(error.code, error.message, f"{prefix}.{error.field}" if error.field else prefix)
