"""A small synchronous Python client of a MegaScope server (docs/megascope_protocol.md), for notebooks:

    from megascope.client import MegaScopeClient
    with MegaScopeClient("ws://127.0.0.1:5001") as scope:
        run = scope.capture(["The cat sat on the"], hooks=["resid_post"], layers=[3, 4])
        run.activation("blocks.3.resid_post", prompt=0)        # numpy [tokens, hidden]
        patched = scope.patch(["A prompt", "B prompt"],
                              [{"hook": "resid_post", "layers": [3], "source": {"prompt": 1}}])
        scope.perturb([{"kind": "system", "target": "resid_post", "noise": "gaussian", "scale": 0.1}])

Every call sends one request and reads until its answer; an error frame that answers it is raised as
``MegaScopeError`` (its code, message and field). Data frames are decoded by megascope.wire (the one decoder).
"""

import contextlib
import itertools
import json
from dataclasses import dataclass, field

import numpy as np
from websockets.sync.client import connect

from megascope.wire import PROTOCOL_VERSION, decode_data_frame


class MegaScopeError(Exception):
    """The server's error frame: ``code`` (e.g. "bad_field"), ``message`` and the offending ``field``."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(f"{code}: {message}" + (f" (field {field})" if field else ""))
        self.code, self.message, self.field = code, message, field


@dataclass
class Activation:
    """One hook's values for one prompt over positions [start, start + len(values))."""
    hook: str
    prompt_index: int
    start: int
    values: np.ndarray
    dims: list


@dataclass
class Generation:
    """What a ``generate`` streamed: the messages as sent (``started``, ``done``, ``tokens``: the token
    messages of every step, ``logit_lens``, ``pca``) and the data frames joined per hook and prompt."""
    started: dict
    done: dict
    tokens: list = field(default_factory=list)
    logit_lens: list = field(default_factory=list)
    pca: dict | None = None
    activations: dict = field(default_factory=dict)   # (hook full name, prompt index) -> Activation

    @property
    def texts(self) -> list:
        return self.done["texts"]

    @property
    def generated(self) -> list:
        return self.done["tokens"]

    def activation(self, hook: str, prompt: int = 0, position: int | None = None) -> np.ndarray:
        """The values of ``hook`` (full name, e.g. "blocks.3.resid_post") for ``prompt``: [tokens, ...] from the
        first position captured (``activations[...].start``), or the values at one absolute ``position``."""
        captured = self.activations[(hook, prompt)]
        if position is None:
            return captured.values
        if not captured.start <= position < captured.start + len(captured.values):
            raise IndexError(f"{hook} of prompt {prompt} was captured at positions [{captured.start}, "
                             f"{captured.start + len(captured.values)}), not at {position}")
        return captured.values[position - captured.start]

    def step(self, step: int, prompt: int = 0) -> dict | None:
        """The token message entry of ``prompt`` at ``step`` (token_id, prob, logprob, topk), or None."""
        for message in self.tokens:
            if message["step"] == step:
                return next((entry for entry in message["tokens"] if entry["prompt_index"] == prompt), None)
        return None


def _joined(frames):
    """{(hook, prompt): Activation} from (header, values) frames, each position once, in position order."""
    pieces = {}
    for header, values in frames:
        pieces.setdefault((header["hook"], header["prompt_index"]), []).append((header, values))
    joined = {}
    for key, parts in pieces.items():
        parts.sort(key=lambda part: part[0]["tokens"][0])
        ends = [part[0]["tokens"] for part in parts]
        if any(end != start for (_, end), (start, _) in itertools.pairwise(ends)):
            raise MegaScopeError("internal", f"the data frames of {key[0]} (prompt {key[1]}) do not join up")
        values = np.concatenate([np.asarray(v, dtype=np.float32) for _, v in parts])
        joined[key] = Activation(key[0], key[1], ends[0][0], values, parts[0][0]["dims"])
    return joined


class MegaScopeClient:
    """A connection to a MegaScope inference server, welcomed. ``token``: the server's token (needed when it
    listens on a host other than localhost). ``timeout``: seconds to wait for any one message."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 300):
        self.timeout = timeout
        self._numbers = itertools.count(1)
        self._open = contextlib.ExitStack()
        self._connection = self._open.enter_context(connect(url, max_size=None, open_timeout=timeout))
        self.welcome = self._request({"type": "hello", "protocol": PROTOCOL_VERSION, "token": token}, "welcome")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._open.close()

    @property
    def model(self) -> dict:
        """The welcome's model shape and layout (num_layers, hidden_size, heads, vocab_size, tp, pp, dp)."""
        return self.welcome["model"]

    # -- requests -------------------------------------------------------------------------------
    def generate(self, prompts: list, tokens_to_generate: int = 32, capture: dict | None = None,
                 patch: list | None = None, **sampling) -> Generation:
        """One ``generate`` (sampling fields as in the protocol: temperature, top_k, top_p, random_seed, ...)
        and everything it streamed, until its generation_done."""
        request = {"type": "generate", "prompts": list(prompts), "tokens_to_generate": tokens_to_generate,
                   "capture": capture, "patch": list(patch or []), **sampling}
        number = self._send(request)
        frames: list[tuple[dict, np.ndarray]] = []
        streamed: dict[str, list[dict]] = {"token": [], "logit_lens": []}  # message type -> its messages in order
        once: dict[str, dict] = {}  # message type -> its one message
        while True:
            message = self._receive(number)
            if isinstance(message, bytes):
                frames.append(decode_data_frame(message))
            elif message["type"] in streamed:
                streamed[message["type"]].append(message)
            elif message["type"] in ("generation_started", "pca"):
                once[message["type"]] = message
            elif message["type"] == "generation_done":
                break
        if message["dropped_frames"]:
            raise MegaScopeError("dropped", f"the server's send queue dropped {message['dropped_frames']} data "
                                 "frames of this generation: capture fewer hooks or layers, reduce them, or "
                                 "start the server with a larger --ws-send-queue-frames")
        return Generation(started=once["generation_started"], done=message, tokens=streamed["token"],
                          logit_lens=streamed["logit_lens"], pca=once.get("pca"), activations=_joined(frames))

    def capture(self, prompts: list, hooks: list, tokens_to_generate: int = 0, patch: list | None = None,
                sampling: dict | None = None, **capture) -> Generation:
        """The activations at ``hooks`` (names without ``blocks.{l}.``; further CaptureSpec fields such as
        layers, tokens, reduction, logit_lens as keywords) of the prompts, read by the prefill alone unless
        ``tokens_to_generate`` > 0."""
        return self.generate(prompts, tokens_to_generate, capture={"hooks": list(hooks), **capture}, patch=patch,
                             **(sampling or {}))

    def patch(self, prompts: list, patches: list, tokens_to_generate: int = 1, capture: dict | None = None,
              **sampling) -> Generation:
        """A generation with activation patches (docs/megascope_protocol.md, Patch): by default one step, whose
        token messages hold each prompt's next-token distribution (top-k) under the patches."""
        return self.generate(prompts, tokens_to_generate, capture=capture, patch=patches, **sampling)

    def perturb(self, perturbations: list) -> list:
        """Replace the server's active perturbations (``[]`` clears them); the normalised active set."""
        number = self._send({"type": "perturb", "perturbations": list(perturbations)})
        while True:
            message = self._receive(number)
            if isinstance(message, dict) and message["type"] == "perturbations":
                return message["active"]

    # -- the connection -------------------------------------------------------------------------
    def _send(self, message):
        number = f"py{next(self._numbers)}"
        self._connection.send(json.dumps({**message, "id": number}))
        return number

    def _request(self, message, reply_type):
        number = self._send(message)
        while True:
            reply = self._receive(number)
            if isinstance(reply, dict) and reply["type"] == reply_type:
                return reply

    def _receive(self, number):
        """The next frame: bytes (a data frame) or a message; an error frame answering ``number`` is raised."""
        frame = self._connection.recv(timeout=self.timeout)
        if isinstance(frame, bytes):
            return frame
        message = json.loads(frame)
        if message["type"] == "error" and message.get("id") in (number, None):
            raise MegaScopeError(message["code"], message["message"], message.get("field"))
        return message
