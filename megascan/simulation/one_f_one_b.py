"""What one pipeline stage runs in one training iteration of a GPT on DP x TP x PP: megatron-core's
non-interleaved 1F1B schedule, as a list of steps for megascan/simulation/training_simulator.py.

Steps (tuples, so that simulating a thousand ranks stays cheap):
- ``("compute", event name or None, microbatch, layer, units)``: the GPU busy for ``units`` layer
  halves' forward time; the name is the trace event it records (None: work no event covers, e.g. the
  host fetching the next batch);
- ``("begin", name, microbatch)`` / ``("end", name, microbatch)``: the bounds of an enclosing event
  (forward, backward, optimizer);
- ``("collective", role, op, phase, microbatch, bytes, cost_us)``: a blocking collective on the rank's
  group of that role, ``cost_us`` once its last member has arrived;
- ``("exchange", ((kind, peer stage), ...), microbatch)``: sends and recvs posted together
  (megatron-core's ``send_forward_recv_backward`` and friends); it completes when all its transfers do.
"""

ATTENTION_UNITS = 1.0  # a layer half's forward; its backward takes twice as long
EMBEDDING_UNITS = 0.2
LOSS_UNITS = 0.6  # output layer and cross-entropy on the last stage
OPTIMIZER_UNITS = 0.8
DATA_UNITS = 0.1  # the host fetching a batch before the first microbatch
TP_ALLREDUCE_US = 40.0
GRAD_ALLREDUCE_US = 3_000.0
EMBEDDING_ALLREDUCE_US = 200.0
GRAD_NORM_ALLREDUCE_US = 30.0
ACTIVATION_BYTES = 8 * 1024 * 1024


def _tp_allreduce(steps, tp, phase, microbatch):
    if tp > 1:
        steps.append(("collective", "tp", "allreduce", phase, microbatch, ACTIVATION_BYTES, TP_ALLREDUCE_US))


def _forward(steps, stage, stages, layers, tp, microbatch):
    steps.append(("begin", "forward", microbatch))
    if stage == 0:
        steps.append(("compute", None, microbatch, None, EMBEDDING_UNITS))
    for layer in layers:
        for half in ("attention-forward", "mlp-forward"):
            steps.append(("compute", half, microbatch, layer, ATTENTION_UNITS))
            _tp_allreduce(steps, tp, "forward", microbatch)
    if stage == stages - 1:
        steps.append(("compute", "loss", microbatch, None, LOSS_UNITS))
    steps.append(("end", "forward", microbatch))


def _backward(steps, stage, layers, tp, microbatch):
    steps.append(("begin", "backward", microbatch))
    for layer in reversed(layers):
        for half in ("mlp-backward", "attention-backward"):
            steps.append(("compute", half, microbatch, layer, 2 * ATTENTION_UNITS))
            _tp_allreduce(steps, tp, "backward", microbatch)
    if stage == 0:
        steps.append(("compute", None, microbatch, None, EMBEDDING_UNITS))
    steps.append(("end", "backward", microbatch))


def _exchange(steps, stage, stages, microbatch, *transfers):
    """Only the transfers whose peer stage exists: the first stage receives no activations, the last no gradients."""
    kept = tuple((kind, peer) for kind, peer in transfers if 0 <= peer < stages)
    if kept:
        steps.append(("exchange", kept, microbatch))


def stage_program(stage, stages, microbatches, layers, dp, tp):
    """The steps of one iteration on pipeline stage ``stage`` holding transformer ``layers`` (1-based)."""
    steps = [("compute", None, None, None, DATA_UNITS)]
    prev, succ = stage - 1, stage + 1
    warmup = min(stages - stage - 1, microbatches)
    remaining = microbatches - warmup
    for m in range(warmup):
        _exchange(steps, stage, stages, m, ("recv", prev))
        _forward(steps, stage, stages, layers, tp, m)
        _exchange(steps, stage, stages, m, ("send", succ))
    if remaining:
        _exchange(steps, stage, stages, warmup, ("recv", prev))
    for i in range(remaining):
        _forward(steps, stage, stages, layers, tp, warmup + i)
        _exchange(steps, stage, stages, warmup + i, ("send", succ), ("recv", succ))
        _backward(steps, stage, layers, tp, i)
        if i == remaining - 1:
            _exchange(steps, stage, stages, i, ("send", prev))
        else:
            _exchange(steps, stage, stages, i, ("send", prev), ("recv", prev))
    for m in range(remaining, microbatches):
        _exchange(steps, stage, stages, m, ("recv", succ))
        _backward(steps, stage, layers, tp, m)
        _exchange(steps, stage, stages, m, ("send", prev))
    if dp > 1:
        steps.append(("collective", "dp_cp", "allreduce_coalesced", "all-grads-sync", None, 64 * ACTIVATION_BYTES,
                      GRAD_ALLREDUCE_US))
    if stages > 1 and stage in (0, stages - 1):
        steps.append(("collective", "embd", "allreduce", "embedding-grads-all-reduce", None, ACTIVATION_BYTES,
                      EMBEDDING_ALLREDUCE_US))
    steps.append(("begin", "optimizer", None))
    if stages * tp > 1:
        steps.append(("collective", "mp", "allreduce", "optimizer", None, 4, GRAD_NORM_ALLREDUCE_US))
    steps.append(("compute", None, None, None, OPTIMIZER_UNITS))
    steps.append(("end", "optimizer", None))
    return steps
