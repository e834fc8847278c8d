"""What one pipeline rank has done in an iteration and which actions it may run next.

Forwards and backwards of one model chunk run in microbatch order (the data iterators hand out
microbatches in order, and every channel then carries one FIFO stream), so per chunk only the next
forward and the next backward are candidates. A forward also needs room under the activation cap,
except for the oldest unfinished microbatch, which always may run: that exception is what makes the
cap unable to deadlock the pipeline (docs/megadpp.md, "Why it cannot deadlock").
Whether a candidate's input has arrived is for the caller to say (the runtime polls its transport,
the simulator reads its clock).
"""

from megadpp.actions import BACKWARD, FORWARD, Action


class StageProgress:
    def __init__(self, layout, microbatches, cap, forward_only=False):
        self.layout = layout
        self.microbatches = microbatches
        self.cap = cap
        self.forward_only = forward_only
        self.next_forward = [0] * layout.chunks
        self.next_backward = [0] * layout.chunks
        self.held = 0  # activations kept for a backward
        self.peak_held = 0
        self.executed = []

    def done(self):
        finished = self.next_forward if self.forward_only else self.next_backward
        return all(n == self.microbatches for n in finished)

    def oldest_unfinished(self):
        """The oldest microbatch this rank still has work for: its chunk-0 backward finishes it here."""
        return self.next_backward[0]

    def candidates(self):
        found = []
        for chunk in range(self.layout.chunks):
            m = self.next_forward[chunk]
            if m < self.microbatches and (self.forward_only or self.held < self.cap
                                          or m == self.oldest_unfinished()):
                found.append(Action(FORWARD, chunk, m))
            m = self.next_backward[chunk]
            if not self.forward_only and m < self.next_forward[chunk]:
                found.append(Action(BACKWARD, chunk, m))
        return found

    def record(self, action):
        self.executed.append(action)
        if action.kind == FORWARD:
            self.next_forward[action.chunk] += 1
            if not self.forward_only:
                self.held += 1
                self.peak_held = max(self.peak_held, self.held)
        else:
            self.next_backward[action.chunk] += 1
            self.held -= 1
