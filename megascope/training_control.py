"""What the clients of a training run asked for (global rank 0 only), read by the loop at its control points.

The WebSocket thread writes (pause / resume / step n / stop, a new capture spec, new perturbations); the
training thread reads one decision per control point and broadcasts it, so every rank acts alike. A train
request is answered at the control point where it takes effect (not when it arrives): only there is the
iteration it pauses, resumes or stops at known (a pause that arrives mid-iteration pauses after that one).
"""

import threading

RUNNING, PAUSED, STOPPING = "running", "paused", "stopping"


class TrainingControl:
    def __init__(self, start_paused=False):
        self._changed = threading.Condition()
        self.state = PAUSED if start_paused else RUNNING
        self.steps_left = None   # "step n": iterations still to run before pausing
        self.pending = {}        # "capture": JSON or None, "perturbations": [JSON]: applied at the next point
        self.unanswered = []     # the reply callbacks of train requests, answered at the next control point

    def request(self, action, n=1, reply=None):
        """A client's train action; ``reply(state, iteration)`` answers it at the next control point."""
        with self._changed:
            if reply is not None:
                self.unanswered.append(reply)
            if self.state != STOPPING:
                if action == "pause":
                    self.state, self.steps_left = PAUSED, None
                elif action == "resume":
                    self.state, self.steps_left = RUNNING, None
                elif action == "step":
                    self.state, self.steps_left = RUNNING, n
                else:
                    self.state = STOPPING
            self._changed.notify_all()

    def set_pending(self, key, value):
        with self._changed:
            self.pending[key] = value
            self._changed.notify_all()

    def decide(self, finished_iteration):
        """The decision of this control point: {"action": "run" | "pause" | "stop", pending changes...,
        "paused_by_step": True when a "step n" has just run its n iterations}, and the reply callbacks of the
        train requests it answers (taken under the same lock: a request arriving later waits for the next)."""
        with self._changed:
            paused_by_step = False
            if finished_iteration and self.steps_left is not None:
                self.steps_left -= 1
                if self.steps_left == 0:
                    self.state, self.steps_left, paused_by_step = PAUSED, None, True
            action = {RUNNING: "run", PAUSED: "pause", STOPPING: "stop"}[self.state]
            decision = {"action": action, "paused_by_step": paused_by_step, **self.pending}
            self.pending = {}
            replies, self.unanswered = self.unanswered, []
            return decision, replies

    def take_unanswered(self):
        """The reply callbacks still waiting when the run ends (no control point will answer them)."""
        with self._changed:
            replies, self.unanswered = self.unanswered, []
            return replies

    def wait(self, timeout):
        """While paused: until a client changes something, or ``timeout`` seconds (a heartbeat for the
        other ranks, which wait in the broadcast)."""
        with self._changed:
            if self.state == PAUSED and not self.pending and not self.unanswered:
                self._changed.wait(timeout)
