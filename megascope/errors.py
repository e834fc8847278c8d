"""MegaScope's errors: the base's ProtocolError (megatron/inference/errors.py: a client's request is invalid),
which the servers turn into an error frame {"type": "error", "code", "message", "field"} and go on serving, and
``within`` to name a field inside the message that holds it."""

from megatron.inference.errors import ProtocolError

__all__ = ["ProtocolError", "within"]


def within(error: ProtocolError, prefix: str) -> ProtocolError:
    """``error`` with its field named inside ``prefix``: a capture spec's "topk" is the message's
    "capture.topk", the third perturbation's "scale" is "perturbations.2.scale"."""
    return ProtocolError(error.code, error.message, f"{prefix}.{error.field}" if error.field else prefix)
