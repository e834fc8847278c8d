"""MegaScope's training mode: one WebSocket server (global rank 0) for a training run at any layout.

Every rank holds a TrainingSession. At each control point (after setup, after every iteration) rank 0
turns what the clients asked for into a decision and broadcasts it over a gloo group (host memory, no
device sync); every rank then applies the same capture spec and perturbations and runs, pauses (with a
heartbeat every second, so no collective times out) or stops (the loop's ``request_stop``: it ends after
the iteration, saving with --save).
With a client connected each iteration also streams its losses, learning rate, grad norm and per-layer
norms, and the chosen sample's internals when a capture spec is set. No client: one small broadcast
per iteration and nothing else.
"""

import torch

from megascope.capture import Capture, CaptureSpec
from megascope.capture_spec import parse_capture
from megascope.errors import ProtocolError
from megascope.layer_statistics import LayerStatistics
from megascope.perturbations import Perturbation, PerturbationSet, parse_perturbations
from megascope.training_control import PAUSED, RUNNING, STOPPING, TrainingControl
from megascope.welcome import welcome_info
from megascope.wire import echo_id, encode_data_frame
from megascope.ws_server import Client, MessageHandler, Session, WebSocketServer
from megatron.training.tokenizer import build_tokenizer
from megatron.training.training_log import print_rank_0

HEARTBEAT_SECONDS = 1.0
STATES = {"run": RUNNING, "pause": PAUSED, "stop": STOPPING}  # a decision's action -> the state clients see


class TrainingSession(Session):
    mode = "training"

    def __init__(self, args, model, optimizer, scheduler, request_stop) -> None:
        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler
        self.request_stop = request_stop  # RunContext.request_stop: the loop ends training, saving with --save
        self.group = torch.distributed.new_group(backend="gloo")
        self.is_server = torch.distributed.get_rank() == 0
        self.iteration = 0
        self.spec = None
        self.perturbations = PerturbationSet(model, args)
        self.statistics = LayerStatistics(model, args.num_layers, args.use_distributed_optimizer)
        self.streaming = False
        self.control = TrainingControl(start_paused=args.training_ws_wait) if self.is_server else None
        self.announced = PAUSED if args.training_ws_wait else RUNNING  # the state clients were last told
        self.server = None
        self._handlers: dict[str, MessageHandler] = {  # client message type -> its handler (rank 0)
            "train": self._train, "set_capture": self._set_capture, "perturb": self._perturb}
        if self.is_server:
            # The tokenizer's vocabulary (the output layer's padding rows are no tokens), for the welcome.
            self.vocab_size = build_tokenizer(args).vocab_size
            self.server = WebSocketServer(self, args.training_ws_host, args.training_ws_port,
                                          flags="--training-ws-host/--training-ws-port").start()
            print_rank_0(f"MegaScope training server on ws://{args.training_ws_host}:{self.server.port}"
                         + (" (waiting for a client to resume or step)" if args.training_ws_wait else ""))

    # -- the WebSocket side (rank 0, server thread) --------------------------------------------
    def welcome_info(self) -> dict:
        return welcome_info(self.args, self.vocab_size)

    def on_message(self, client: Client, message: dict) -> None:
        self._handlers[message["type"]](client, message)

    def _train(self, client, message):
        """Answered at the control point where it takes effect (training_control.py)."""
        self.control.request(message["action"], message["n"], reply=(client, echo_id(message)))

    def _set_capture(self, client, message):
        spec = self._checked_spec(message["capture"])
        normalised = None if spec is None else spec.to_json()
        self.control.set_pending("capture", normalised)
        client.send({"type": "capture_set", "capture": normalised, **echo_id(message)})

    def _perturb(self, client, message):
        active = [p.to_json() for p in parse_perturbations(message["perturbations"], self.args.num_layers)]
        self.control.set_pending("perturbations", active)

    def on_welcome(self, client: Client) -> None:
        """A client that connects learns the run's state at once (a run started with --training-ws-wait waits
        for it to resume or step)."""
        client.send(self._state_message(self.announced))

    def on_disconnect(self, client: Client) -> None:
        pass  # the run goes on; what the client set stays until another client changes it

    def _checked_spec(self, obj):
        spec = parse_capture(obj, self.args.num_layers)
        if spec is None:
            return None
        samples = self.args.global_batch_size // self.args.data_parallel_size
        if spec.sample >= samples:
            raise ProtocolError("bad_field", f"sample {spec.sample} is beyond the {samples} samples of an "
                                "iteration on the first data-parallel replica", "capture.sample")
        if spec.attribution:
            raise ProtocolError("bad_field", "attribution explains the tokens a generation chooses; training chooses "
                                "none: use it with the text generation server", "capture.attribution")
        return spec

    def _has_client(self):
        return any(client.welcomed for client in list(self.server.clients))

    # -- the training side (every rank) --------------------------------------------------------
    def control_point(self, iteration, finished_iteration):
        """Collective: wait while paused; returns "run" or "stop" (then every rank asked the loop to stop)."""
        self.iteration = iteration
        while True:
            decision = [None]
            replies = []
            if self.is_server:
                decided, replies = self.control.decide(finished_iteration)
                decision[0] = {**decided, "stream": self._has_client()}
            if self.group.size() > 1:  # alone, the broadcast would only cost its hand-off (about 1 ms)
                torch.distributed.broadcast_object_list(decision, src=0, group=self.group)
            decision = decision[0]
            self._apply(decision)
            self._tell_state(STATES[decision["action"]], replies)
            if decision["action"] == "stop":
                self.request_stop(f"MegaScope: a client stopped training at iteration {iteration}")
            if decision["action"] != "pause":
                return decision["action"]
            finished_iteration = False
            if self.is_server:
                self.control.wait(HEARTBEAT_SECONDS)

    def _apply(self, decision):
        if "capture" in decision:
            self.spec = None if decision["capture"] is None else CaptureSpec.from_json(decision["capture"])
        if "perturbations" in decision:
            self.perturbations.replace([Perturbation.from_json(obj) for obj in decision["perturbations"]])
            self.perturbations.restore_storage()  # storage noise acts inside the forward-backward only
            self._broadcast({"type": "perturbations", "active": decision["perturbations"]})
        if decision["stream"] != self.streaming:
            self.streaming = decision["stream"]
            self.statistics.install() if self.streaming else self.statistics.remove()

    def _state_message(self, state, echo=None):
        """The run's state after the last iteration completed (the one a state applies after)."""
        return {"type": "training_state", "state": state, "iteration": self.iteration, **(echo or {})}

    def _tell_state(self, state, replies):
        """Answer the train requests this control point acted on (each with its id), and tell every other
        client when the state changed."""
        answered = set()
        for client, echo in replies:
            client.send(self._state_message(state, echo))
            answered.add(client)
        if state != self.announced and self.server is not None:
            for client in list(self.server.clients):
                if client.welcomed and client not in answered:
                    client.send(self._state_message(state))
        self.announced = state

    def _broadcast(self, message):
        if self.server is not None:
            self.server.broadcast(message)

    def wrap_schedule(self, schedule):
        def run(*args, forward_only=False, **kwargs):
            if forward_only:
                return schedule(*args, forward_only=forward_only, **kwargs)
            self.perturbations.apply_storage()
            capture = self._capture()
            try:
                if capture is None:
                    return schedule(*args, forward_only=forward_only, **kwargs)
                with capture:
                    result = schedule(*args, forward_only=forward_only, **kwargs)
                    self._send_records(capture.collect(step=self.iteration + 1, token_offset=0))
                    return result
            finally:
                self.perturbations.restore_storage()  # before the optimizer step: its state stays clean
        return run

    def _capture(self):
        if self.spec is None or not self.streaming:
            return None
        per_microbatch = self.args.micro_batch_size
        return Capture(self.model, self.spec, self.args, microbatch=self.spec.sample // per_microbatch,
                       batch_index=self.spec.sample % per_microbatch)

    def _send_records(self, records):
        for record in records:
            self._broadcast_data(record.frame_header(None, self.iteration + 1, prompt_index=self.spec.sample),
                                 record.values)

    def _broadcast_data(self, header, values):
        if self.server is None:
            return
        frame = encode_data_frame(header, values)
        for client in list(self.server.clients):
            if client.welcomed:
                client.send_data(frame)

    def iteration_end(self, iteration, metrics):
        """Collective: stream this iteration (when a client is connected), then the control point."""
        if self.streaming:
            losses = metrics.get("losses") or {}
            activation_norms, grad_norms, lm_loss = self.statistics.reduce(losses.get("lm loss"), self.group)
            grad_norm = metrics.get("grad_norm")
            self._broadcast({
                "type": "iteration", "iteration": iteration, "lm_loss": lm_loss,
                "lr": float(self.scheduler.get_lr(self.optimizer.param_groups[0])),
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "skipped": bool(metrics.get("skipped")), "activation_norms": activation_norms,
                "grad_norms": grad_norms,
                "state": self.control.state if self.control is not None else None})
        self.control_point(iteration, finished_iteration=True)

    def close(self):
        if self.control is not None:
            self._tell_state(STOPPING, self.control.take_unanswered())  # came after the last control point
        self.perturbations.clear()
        self.statistics.remove()
        if self.server is not None:
            self.server.stop(reason=f"training ended at iteration {self.iteration}")
