"""MegaScope's inference mode: the WebSocket session of tools/run_text_generation_server.py.

``InferenceSession`` (rank 0, on the WebSocket thread) checks requests and queues generations on the
GenerationService; ``ScopeObserver`` (every rank) runs around each generation step: it applies rank 0's
control messages (cancel, a new capture, perturbations) on every rank at the same step, reads the capture, and on
rank 0 streams tokens, logit lens, data frames and the PCA to the client.

Where the engine runs a generation on its static cache (one pipeline stage; on a GPU each decode step a CUDA graph),
the capture is a ``CapturePlan`` compiled into the step and rank 0 streams from a thread (``StepStream``) while the
model runs on. Patches and attribution hook megatron-core's own inference path eagerly (``Capture``, ``Patcher``,
``Attribution``): a generation that starts with them runs there, as does every generation at pipeline parallelism
or with calculation noise active. A perturbation sent during a generation on the static cache applies from the next
generation (a graph replays the kernels it captured). See docs/megascope_protocol.md.
"""

import contextlib
import dataclasses
import logging
import sys
import threading

import numpy as np
import torch

from megascope.attribution import Attribution
from megascope.capture import Capture, record_order
from megascope.capture_plan import CapturePlan, records
from megascope.capture_spec import parse_capture
from megascope.errors import ProtocolError
from megascope.hooks import unwrap_model
from megascope.patching import Patch, Patcher, parse_patches
from megascope.pca import pca_2d
from megascope.perturbations import PerturbationSet, parse_perturbations
from megascope.step_stream import PatientSender, StepStream
from megascope.welcome import welcome_info
from megascope.wire import echo_id, encode_data_frame, error_message
from megascope.ws_server import Client, MessageHandler, Session, WebSocketServer
from megatron.inference.engine import NonFiniteLogits, NoObserver
from megatron.inference.greedy import logits as forward_logits
from megatron.inference.jobs import Job
from megatron.inference.limits import Limits
from megatron.inference.prompts import sampling_fields
from megatron.inference.service import pick_seed

log = logging.getLogger("megascope.inference")
DEFAULT_TOPK = 5
# The model thread releases the GIL while it waits for each step on the GPU; the stream and WebSocket threads then
# encode and send. Python takes the GIL back from a busy thread only after the switch interval (5 ms by default),
# which a streaming generation paid on every step (GPT-1B-sized steps take 4 ms): a short one gives it back at once.
SWITCH_INTERVAL_SECONDS = 0.0002
_DEFAULT_LIMITS = Limits()  # frozen: one shared default instance


class ScopeObserver(NoObserver):
    """One generation seen from one rank. ``scope``: {"id", "capture": JSON or None, "patch": [checked patches]}
    (the job's payload); ``client`` and ``session`` only on rank 0."""

    def __init__(self, scope, model, args, client=None, session=None):
        self.id = scope["id"]
        self.model = model
        self.args = args
        self.client = client
        self.session = session
        self.spec = parse_capture(scope["capture"], args.num_layers)
        self.capture = None
        self.attribution = None
        self.patches = [Patch.from_json(obj) for obj in scope.get("patch", [])]
        self.patched = [[] for _ in self.patches]  # per patch: the positions it wrote in the steps
        self.pca_vectors = {}  # layer -> [(prompt_index, token_start, values [tokens, hidden])] of the PCA hook
        self.dropped_at_start = client.dropped_total if client else 0
        self.started = None  # rank 0: the generation_started message
        self.last_position = {}  # prompt index -> the position of its last token, once it has finished
        self.steps_read = (0, 0)  # (steps run, end of the positions read): every row read [0, end)
        self.device = next(model[0].parameters()).device
        self.static = False  # runs on the engine's static cache: the capture is compiled into each step
        self.plan = None     # the CapturePlan of self.spec there
        self.stream = None   # rank 0 there: the thread that streams each step
        self.frames = PatientSender(client) if client is not None else None  # rank 0: every data frame goes here
        self._landed = {}    # rank 0 there: step index -> (its landed capture, its slots, its CaptureSpec)

    # -- the path: the static cache unless a feature hooks megatron-core's own path eagerly --
    def core_path(self):
        return bool(self.patches) or bool(self.spec and self.spec.attribution)

    def path_chosen(self, static_cache):
        self.static = static_cache
        if static_cache and self.client is not None:
            self.stream = StepStream(self.device)

    def step_launched(self, index, readout):
        """Rank 0 on the slot cache: land the step's packed capture on the host now, before a later step overwrites
        it; it is streamed once the step's tokens are known."""
        if self.stream is not None and readout is not None:
            self._landed[index] = (self.stream.land(readout.values), readout.slots, self.spec)

    def readout(self, index, start, end):
        if self.spec is None or not any(self.spec.wants_token(position) for position in range(start, end)):
            return None
        if self.plan is None or self.plan.spec is not self.spec:
            self.plan = CapturePlan(self.spec, unwrap_model(self.model[0]).config)
        return self.plan

    # -- control: rank 0 drains the session's mailbox; every rank applies it at the same step --
    def poll(self):
        if self.started is not None:  # sent from the model loop: before any token, after the queue took it
            self.client.send(self.started)
            self.started = None
        return self.session.take_control(self.client) if self.session else None

    def apply(self, control):
        if not control:
            return False
        if "capture" in control:
            self.spec = parse_capture(control["capture"], self.args.num_layers)
        if "perturbations" in control and not self.static:  # else the service applies them after this generation
            apply_perturbations(self.model, self.args, control["perturbations"])
        return bool(control.get("cancel"))

    # -- capture around each forward --
    def forward(self, index, start, end):
        """The patches (first: the capture sees the patched activations), the capture and the attribution around
        one step."""
        around = contextlib.ExitStack()
        if self.patches:
            around.enter_context(Patcher(self.model, self.patches, start))
            for positions, patch in zip(self.patched, self.patches):
                positions.extend(patch.positions_within(start, end))
        if self.spec is not None and not self.static:
            self.capture = around.enter_context(Capture(self.model, self.spec, self.args))
            if self.spec.attribution:
                self.attribution = around.enter_context(Attribution(self.model))
        return around

    def step_done(self, step):
        if self.static:
            return self._stream_from_thread(step)
        records = self.capture.collect(step=step.index, token_offset=step.start) if self.capture is not None else []
        attributions = [] if self.attribution is None else self.attribution.collect(step.draw.tokens, step.sampled,
                                                                                     step.end)
        self.capture = self.attribution = None
        self.steps_read = (step.index + 1, step.end)
        if self.client is None:
            return
        windows, lens_positions = self._windows(step)
        self._stream(records, step.index, windows, lens_positions, self.spec)
        for attribution in attributions:
            self.frames.send_data(attribution.data_frame(self.id, step.index))
        self._send_tokens(step)

    def _windows(self, step):
        """Rank 0: (each prompt's window of positions to stream, the position its logit lens is read at) for
        ``step``; then the prompts that finished with it are noted. A finished prompt's row is streamed up to its
        last token, then it is padding, not text."""
        windows = {row: (0, position + 1) for row, position in self.last_position.items()}
        self.last_position.update({row: step.end for row in step.finished})
        return windows, {row: step.end - 1 for row in range(len(step.draw.tokens))}

    def _stream_from_thread(self, step):
        """The static cache's step: rank 0 hands its packed capture (still on the device) and what the step chose
        to the stream's thread, which sends what the step above sends, in the same order."""
        self.steps_read = (step.index + 1, step.end)
        if self.client is None:
            return
        windows, lens_positions = self._windows(step)
        # The capture of the step's launch: a set_capture may have changed it for the steps launched since.
        landed, slots, spec = self._landed.pop(step.index, (None, None, self.spec))

        def send(host_values):
            step_records = [] if landed is None else sorted(
                records(host_values, slots, spec, step.start, step.end), key=record_order)
            self._stream(step_records, step.index, windows, lens_positions, spec)
            self._send_tokens(step)
        self.stream.submit(landed, send)

    def close_stream(self):
        """Rank 0: every step streamed (the stream's thread ends)."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def after(self, generation):
        """Every rank: one final forward over the whole texts, for the positions no step read (each prompt's
        last token, chosen by the last step that ran for it), so that data frames and PCA cover every token of
        every prompt exactly once. With no capture: nothing."""
        if self.stream is not None:
            self.stream.flush()  # every step's frames first
        self._read_last_tokens(generation)
        self.close_stream()

    def _read_last_tokens(self, generation):
        if self.spec is None:
            return
        steps, read_end = self.steps_read
        lengths = [len(tokens) for tokens in generation.tokens]
        if all(length <= read_end for length in lengths):
            return
        texts = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        for row, tokens in enumerate(generation.tokens):
            texts[row, :len(tokens)] = torch.tensor(tokens)
        with Patcher(self.model, self.patches, 0), Capture(self.model, self.spec, self.args) as capture:
            forward_logits(self.model, texts.to(self.device), 0)
            records = capture.collect(step=steps, token_offset=0)
        if self.client is not None:
            self._stream(records, steps, {row: (read_end, length) for row, length in enumerate(lengths)},
                         {row: length - 1 for row, length in enumerate(lengths)}, self.spec)

    def _stream(self, records, step, windows, lens_positions, spec):
        """Rank 0: send ``records`` cut to each prompt's window [first, end) of positions (all when it has
        none) as data frames, and the logit lens at each prompt's position in ``lens_positions``."""
        lens = {}  # prompt index -> its layers' top-k
        for record in records:
            record = _within(record, *windows.get(record.prompt_index, (0, None)))
            if record is None:
                continue
            if record.hook == "logit_lens":
                if record.token_start + record.values.shape[0] - 1 == lens_positions[record.prompt_index]:
                    lens.setdefault(record.prompt_index, []).append(self._lens_layer(record))
                continue
            if self._wanted_by_pca(record, spec):
                self.pca_vectors.setdefault(record.layer, []).append(
                    (record.prompt_index, record.token_start, record.values.numpy()))
            self.frames.send_data(encode_data_frame(record.frame_header(self.id, step), record.values))
        for prompt_index, layers in sorted(lens.items()):
            self.client.send({"type": "logit_lens", "id": self.id, "step": step,
                              "prompt_index": prompt_index, "layers": layers})

    def _wanted_by_pca(self, record, spec):
        """Whether ``record`` holds vectors of the PCA hook at a layer the PCA covers (pca.layer null: every
        captured layer of a per-layer hook, so the page can show any of them without generating again)."""
        pca = spec.pca
        return pca is not None and record.hook == pca.hook and pca.layer in (None, record.layer) \
            and str(record.reduction) == "none"

    def _send_tokens(self, step):
        text = self.session.encoder.token_text
        chosen = step.draw
        self.client.send({"type": "token", "id": self.id, "step": step.index, "tokens": [
            {"prompt_index": row, "token_id": int(chosen.tokens[row]), "text": text(int(chosen.tokens[row])),
             "prob": float(chosen.probs[row]), "logprob": float(chosen.logprobs[row]),
             "topk": [{"token_id": int(token), "text": text(int(token)), "prob": float(prob)}
                      for token, prob in zip(chosen.topk_ids[row].tolist(), chosen.topk_probs[row].tolist())]}
            for row in step.sampled]})

    def _lens_layer(self, record):
        """One layer's logit lens at the last position of ``record`` ([tokens, k, 2] of token id, probability)."""
        text = self.session.encoder.token_text
        return {"layer": record.layer, "topk": [{"token_id": int(token), "text": text(int(token)), "prob": float(prob)}
                                                for token, prob in record.values[-1].tolist()]}

    def finish(self, generation):
        """Rank 0, after the last step: the PCA of each layer asked for (in layer order) and generation_done."""
        detokenize = self.session.encoder.tokenizer.detokenize
        for layer in sorted(self.pca_vectors, key=lambda layer: -1 if layer is None else layer):
            self.client.send(self._pca_message(layer, self.pca_vectors[layer], generation))
        self.client.send({"type": "generation_done", "id": self.id,
                          "texts": [detokenize(tokens[length:]) for tokens, length in
                                    zip(generation.tokens, generation.prompt_lengths)],
                          "tokens": [tokens[length:] for tokens, length in
                                     zip(generation.tokens, generation.prompt_lengths)],
                          "finish_reason": generation.finish_reasons, "patched": self.patched,
                          "dropped_frames": self.client.dropped_total - self.dropped_at_start})

    def _pca_message(self, layer, vectors, generation):
        """The ``pca`` message of one layer's vectors: one point per token, ordered by prompt, then position."""
        vectors.sort(key=lambda item: (item[0], item[1]))
        coords, ratio = pca_2d(np.concatenate([values.reshape(values.shape[0], -1) for _, _, values in vectors]))
        points, row = [], 0
        for prompt_index, start, values in vectors:
            for position in range(start, start + values.shape[0]):
                points.append({"prompt_index": prompt_index, "token_index": position,
                               "text": self.session.encoder.token_text(generation.tokens[prompt_index][position]),
                               "x": float(coords[row][0]), "y": float(coords[row][1])})
                row += 1
        return {"type": "pca", "id": self.id, "hook": self.spec.pca.hook, "layer": layer, "points": points,
                "explained_variance": [float(r) for r in ratio]}


def _within(record, first, end):
    """``record`` cut to positions [first, end) (end None: to its end); None when nothing is left."""
    stop = record.token_start + record.values.shape[0]
    start, end = max(record.token_start, first), stop if end is None else min(stop, end)
    if start >= end:
        return None
    if (start, end) == (record.token_start, stop):
        return record
    return dataclasses.replace(record, token_start=start,
                               values=record.values[start - record.token_start:end - record.token_start])


_active_perturbations: dict[int, PerturbationSet] = {}  # id(model) -> its perturbations


def apply_perturbations(model, args, objs):
    """Every rank: replace the active perturbation set (the library restores storage noise exactly)."""
    active = _active_perturbations.get(id(model))
    if active is None:
        active = _active_perturbations[id(model)] = PerturbationSet(model, args)
    active.replace(parse_perturbations(objs, args.num_layers))


class InferenceSession(Session):
    """Rank 0's WebSocket session."""
    mode = "inference"

    def __init__(self, service, encoder, model, args, limits=_DEFAULT_LIMITS) -> None:
        self.service = service
        self.encoder = encoder
        self.model = model
        self.args = args
        self.limits = limits
        self.server: WebSocketServer | None = None  # set by the caller: broadcasts perturbations
        self._lock = threading.Lock()
        self._running: dict[Client, Job] = {}            # client -> its running generation's Job
        self._control: dict[Client, dict] = {}           # client -> pending control for its running generation
        self._captures: dict[Client, dict | None] = {}   # client -> its set_capture spec (JSON)
        self._numbers = 0
        self._handlers: dict[str, MessageHandler] = {  # client message type -> its handler
            "generate": self._generate, "cancel": self._cancel, "set_capture": self._set_capture,
            "perturb": self._perturb}
        sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)

    def on_welcome(self, client: Client) -> None:
        pass  # generations start from the client's requests: nothing to tell at once

    def welcome_info(self) -> dict:
        return welcome_info(self.args, self.encoder.tokenizer.vocab_size)

    def on_message(self, client: Client, message: dict) -> None:
        self._handlers[message["type"]](client, message)

    def on_disconnect(self, client: Client) -> None:
        with self._lock:
            self._captures.pop(client, None)
            if client in self._running:
                self._cancel_job(client)

    def _cancel_job(self, client):
        """Under the lock: stop ``client``'s generation at its next step."""
        self._running[client].cancelled = True
        self._control.setdefault(client, {})["cancel"] = True

    def take_control(self, client):
        """Rank 0, between steps: the pending control of ``client``'s generation (and new perturbations); a
        cancel once the server is stopping."""
        with self._lock:
            control = self._control.pop(client, None) or None
        if self.service.stopping:
            return {**(control or {}), "cancel": True}
        return control

    def _generate(self, client, message):
        request = message
        prompts = self.encoder.encode(request)
        capture = self._captures.get(client) if request["capture"] == "connection" else request["capture"]
        spec = parse_capture(capture, self.args.num_layers)
        patches = [patch.to_json() for patch in parse_patches(request["patch"], self.welcome_info()["model"],
                                                              len(prompts))]
        seed = pick_seed(request["random_seed"])
        with self._lock:
            self._numbers += 1
            gen_id = message.get("id", f"g{self._numbers}")
        topk = spec.topk if spec is not None else DEFAULT_TOPK
        if topk > self.limits.max_topk:
            raise ProtocolError("bad_field", f"capture.topk must be at most {self.limits.max_topk}", "capture.topk")
        payload = {"kind": "generate", "prompts": prompts, "params": sampling_fields(request, seed, topk),
                   "scope": {"id": gen_id, "capture": capture, "patch": patches}}
        observer = ScopeObserver(payload["scope"], self.model, self.args, client, self)
        observer.started = {"type": "generation_started", "id": gen_id, "random_seed": seed, "prompt_tokens": [
            [{"id": token, "text": self.encoder.token_text(token)} for token in tokens] for tokens in prompts],
            "patch": patches}
        job = Job(payload=payload, observer=observer, source="websocket")
        with self._lock:  # before the model loop can finish it
            if client in self._running:
                raise ProtocolError("busy", "your generation is running; wait for its generation_done")
            self._running[client] = job
        try:
            self.service.submit(job, refuse_if_busy=True)
        except ProtocolError:
            with self._lock:
                self._running.pop(client, None)
            raise
        threading.Thread(target=self._finish, args=(client, job), daemon=True).start()

    def _finish(self, client, job):
        job.done.wait()
        job.observer.close_stream()  # a generation that failed never reached its last step's after()
        with self._lock:
            self._running.pop(client, None)
            self._control.pop(client, None)  # came after the last step: _perturb queued its control job too
        if job.error is not None:
            if isinstance(job.error, NonFiniteLogits):  # the request broke the model, not the server
                log.warning("generation %s ended: %s", job.observer.id, job.error)
                client.send(error_message("non_finite", str(job.error), id=job.observer.id))
            else:
                log.error("generation %s failed: %s", job.observer.id, job.error, exc_info=job.error)
                client.send(error_message("internal", "the generation failed; see the server log", id=job.observer.id))
            prompts = len(job.payload["prompts"])
            client.send({"type": "generation_done", "id": job.observer.id, "texts": [""] * prompts,
                         "tokens": [[] for _ in range(prompts)], "finish_reason": ["error"] * prompts,
                         "patched": job.observer.patched,
                         "dropped_frames": client.dropped_total - job.observer.dropped_at_start})
            return
        job.observer.finish(job.result)

    def _cancel(self, client, message):
        with self._lock:
            job = self._running.get(client)
            if job is None or job.observer.id != message["id"]:
                raise ProtocolError("bad_field", f"no running generation of yours has id {message['id']!r}", "id")
            self._cancel_job(client)

    def _set_capture(self, client, message):
        spec = parse_capture(message["capture"], self.args.num_layers)
        normalised = None if spec is None else spec.to_json()
        with self._lock:
            self._captures[client] = normalised
            if client in self._running:
                self._control.setdefault(client, {})["capture"] = normalised
        client.send({"type": "capture_set", "capture": normalised, **echo_id(message)})

    def _perturb(self, client, message):
        # Checked here, so a bad one is refused before any rank sees it; every rank gets the normalised form.
        active = [p.to_json() for p in parse_perturbations(message["perturbations"], self.args.num_layers)]
        with self._lock:
            for other in self._running:  # from its next step, on the replica that runs it
                self._control.setdefault(other, {})["perturbations"] = active
        # Every rank, after the running generation: the other data-parallel replicas too. Where a generation
        # applied the set already, applying it again puts back the same (seeded) storage noise and restarts
        # the count of forwards that calculation noise is drawn by, as on the replicas that had not seen it.
        self.service.control({"perturbations": active})
        self.server.broadcast({"type": "perturbations", "active": active})
