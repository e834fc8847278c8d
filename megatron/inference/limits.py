"""The bounds a generation server enforces and announces (MegaScope's ``welcome.limits``): per request
(prompts, new tokens, top-k) and, for MegaScope's WebSocket, per connection (message size and rate, the send
queue). docs/megascope_protocol.md ("Limits") lists them with their flags."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.inference.errors import ProtocolError


@dataclass(frozen=True)
class Limits:
    """The bounds a server announces in `welcome.limits` and enforces."""
    max_message_bytes: int = 1 << 20
    max_messages_per_second: int = 50
    send_queue_frames: int = 256
    max_prompts: int = 16
    max_tokens_to_generate: int = 1024
    max_topk: int = 100

    def as_json(self) -> dict[str, int]:
        return dict(self.__dict__)


def check_limits(request: dict, limits: Limits, max_new_tokens: int) -> None:
    """Prompts and new tokens within the server's limits (``max_new_tokens``: what the model's length allows)."""
    if len(request["prompts"]) > limits.max_prompts:
        raise ProtocolError("bad_field", f"at most {limits.max_prompts} prompts per request here, not "
                            f"{len(request['prompts'])}; send the others in another request", "prompts")
    bound = min(limits.max_tokens_to_generate, max_new_tokens)
    if request["tokens_to_generate"] > bound:
        raise ProtocolError("bad_field", f"tokens_to_generate must be at most {bound} here", "tokens_to_generate")
