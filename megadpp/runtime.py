"""The dynamic pipeline schedule: a drop-in for megatron-core's ``forward_backward_func``.

Each pipeline rank keeps one receive posted per incoming channel, polls them, asks its policy which ready
action to run (megadpp/progress.py decides what is a candidate, megadpp/policy.py picks one), and runs
it with megatron-core's own ``forward_step`` / ``backward_step``; outputs and input gradients leave
through non-blocking sends. Gradient reduction waits for the end of the iteration (every chunk under
``no_sync``), then megatron-core's ``finalize_model_grads`` runs as in its schedules.

Tensor-parallel ranks of a stage must run the same order (their layers hold collectives): TP rank 0
decides and broadcasts each action; the others wait for that action's input. docs/megadpp.md argues why
neither this nor the activation cap can deadlock.
"""

import contextlib
import time
from collections import deque

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import (
    backward_step,
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
)
from megatron.core.utils import get_model_config, get_model_type

from megadpp.actions import BACKWARD, FORWARD, Action, StageLayout, peak_in_flight
from megadpp.policy import StaticFirstPolicy
from megadpp.progress import StageProgress
from megadpp.static_orders import static_order
from megatron.training.errors import UserError
from megatron.training.transfer_trace import TransferLabel

_KINDS = (FORWARD, BACKWARD)
_KIND_NAMES = {FORWARD: "forward", BACKWARD: "backward"}  # a message's phase: "forward-send", ... (megatron's)
_IDLE_SLEEP_S = (20e-6, 1e-3)  # back-off while nothing is ready: from, to
_MESSAGE_NAMES = {FORWARD: "activation", BACKWARD: "output gradient"}  # what a stream of each kind carries


class PipelineStallError(UserError):
    """A pipeline neighbour sent nothing (or took nothing) for --dpp-timeout seconds: it is stalled or dead.
    Not the user's mistake, but told the same way: one line naming the peer and the transfer, and an exit."""


def channel_of(kind, receiving_chunk, chunks):
    """The transport tag of a stream: activations into chunk c travel with tag c, gradients into chunk c
    with tag chunks + c. Each stream carries its microbatches in order, and the transport keeps the
    messages of one (peer, tag) in order, so the k-th receive posted on a stream gets microbatch k."""
    return receiving_chunk + (chunks if kind == BACKWARD else 0)


class _Inbox:
    """One posted receive per incoming channel, and what has arrived on it, in microbatch order."""

    def __init__(self, transport, layout, pipeline_ranks, microbatches, forward_only, delay):
        self.transport, self.layout, self.microbatches = transport, layout, microbatches
        self.delay = delay  # (kind, sender's chunk, microbatch, sending pp rank) -> seconds a message stays unseen
        self.received = {}  # (kind, chunk) -> how many messages have arrived
        self.pipeline_ranks = pipeline_ranks
        self.arrived = {}
        self.pending = {}
        self.remaining = {}
        for chunk in range(layout.chunks):
            if not layout.is_first(chunk):
                self._open(FORWARD, chunk, microbatches)
            if not forward_only and not layout.is_last(chunk):
                self._open(BACKWARD, chunk, microbatches)

    def _open(self, kind, chunk, microbatches):
        key = (kind, chunk)
        self.arrived[key], self.remaining[key], self.received[key] = deque(), microbatches, 0
        self._post(key)

    def _post(self, key):
        kind, chunk = key
        if self.remaining[key] == 0:
            return
        microbatch = self.microbatches - self.remaining[key]  # each stream carries its microbatches in order
        self.remaining[key] -= 1
        peer_rank, _ = (self.layout.upstream if kind == FORWARD else self.layout.downstream)(chunk)
        handle = self.transport.irecv(self.pipeline_ranks[peer_rank], tag=channel_of(kind, chunk, self.layout.chunks))
        handle.label = TransferLabel(f"{_KIND_NAMES[kind]}-recv", microbatch, chunk)
        self.pending[key] = handle

    def poll(self):
        for key, handle in list(self.pending.items()):
            if handle.is_completed():
                del self.pending[key]
                visible_at = handle.end_ns / 1e9  # when it arrived (perf_counter), however late this poll
                if self.delay is not None:
                    kind, chunk = key
                    sender, sender_chunk = (self.layout.upstream if kind == FORWARD else self.layout.downstream)(chunk)
                    visible_at += self.delay(kind, sender_chunk, self.received[key], sender)
                self.received[key] += 1
                self.arrived[key].append((visible_at, handle.wait()))
                self._post(key)

    def describe_wait(self, kind, chunk, microbatch):
        """The message an action waits for, and who sends it: for a stall report."""
        sender, sender_chunk = (self.layout.upstream if kind == FORWARD else self.layout.downstream)(chunk)
        return (f"the {_MESSAGE_NAMES[kind]} of microbatch {microbatch} for chunk {chunk} from rank "
                f"{self.pipeline_ranks[sender]} (its chunk {sender_chunk}, transport tag "
                f"{channel_of(kind, chunk, self.layout.chunks)})")

    def has(self, kind, chunk):
        queue = self.arrived[(kind, chunk)]
        return bool(queue) and queue[0][0] <= time.perf_counter()

    def take(self, kind, chunk):
        return self.arrived[(kind, chunk)].popleft()[1]


def default_caps(stages, chunks, microbatches, group_size):
    """What megatron-core's static schedule holds on each pipeline rank: DPP's default activation cap."""
    return [peak_in_flight(static_order(r, stages, chunks, microbatches, group_size)) for r in range(stages)]


class DynamicPipelineSchedule:
    """Called like megatron-core's schedules; ``transport`` moves tensors between pipeline ranks."""

    def __init__(self, policy, transport, max_in_flight=None, schedule_log=None, arrival_delay=None,
                 stall_timeout=None):
        self.policy_name = policy
        self.transport = transport
        self.stall_timeout = stall_timeout  # seconds without progress before a wait is a stalled peer; None: wait on
        self.max_in_flight = max_in_flight
        self.schedule_log = schedule_log  # records what each iteration ran, or None
        self.arrival_delay = arrival_delay  # fault injection: holds received messages back (fault_injection.py)

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                 micro_batch_size, decoder_seq_length=None, forward_only=False, collect_non_loss_data=False,
                 first_val_step=None, **_unused):
        model = model if isinstance(model, list) else [model]
        data_iterator = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        run = _Iteration(self, model, data_iterator, forward_step_func, num_microbatches,
                         seq_length, micro_batch_size, decoder_seq_length, forward_only,
                         collect_non_loss_data, first_val_step)
        return run.execute()


class _Iteration:
    def __init__(self, schedule, model, data_iterator, forward_step_func, microbatches, seq_length,
                 micro_batch_size, decoder_seq_length, forward_only, collect_non_loss_data, first_val_step):
        self.schedule, self.model, self.data_iterator = schedule, model, data_iterator
        self.forward_step_func, self.microbatches = forward_step_func, microbatches
        self.forward_only, self.collect_non_loss_data = forward_only, collect_non_loss_data
        self.first_val_step = first_val_step
        self.config = config = get_model_config(model[0])
        self.model_type = get_model_type(model[0])
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        stages = pp_group.size()
        self.layout = StageLayout(pp_group.rank(), stages, len(model))
        self.pipeline_ranks = dist.get_process_group_ranks(pp_group)
        self.device = next(model[0].parameters()).device
        self.inbox = _Inbox(schedule.transport, self.layout, self.pipeline_ranks, microbatches, forward_only,
                            schedule.arrival_delay)
        group_size = config.microbatch_group_size_per_vp_stage or stages
        cap = schedule.max_in_flight or default_caps(stages, len(model), microbatches, group_size)[self.layout.pp_rank]
        self.progress = StageProgress(self.layout, microbatches, cap, forward_only)
        self.policy = StaticFirstPolicy(schedule.policy_name, self.layout, microbatches, group_size)
        self.free_since = time.monotonic()  # when the latest action ended: the policy's deadline counts from it
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_leader = parallel_state.get_tensor_model_parallel_src_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.stash = {}  # (chunk, microbatch) -> (input, output) kept for the backward
        self.sends = []
        self.forward_data_store = []
        self.total_tokens = torch.zeros([], dtype=torch.int, device=self.device)

    def execute(self):
        config = self.config
        timer = self.config.timers('forward-backward', log_level=1) if config.timers is not None else None
        if timer is not None:
            timer.start(barrier=config.barrier_with_L1_time)
        with contextlib.ExitStack() as no_sync:
            if not self.forward_only:
                self._start_param_sync()
                for chunk in self.model:
                    no_sync.enter_context(chunk.no_sync())  # reduce once, in a fixed order, at the end
            while not self.progress.done():
                action = self._next_action()
                self.progress.record(action)
                started = time.monotonic()
                (self._forward if action.kind == FORWARD else self._backward)(action)
                self.free_since = time.monotonic()
                self.policy.ran(self.free_since - started)
        for handle in self.sends:
            self._wait(handle)
        if self.schedule.schedule_log is not None:
            self.schedule.schedule_log.record(self.layout, self.progress.executed, self.forward_only)
        if not self.forward_only:
            self._finish_grad_sync()
        if timer is not None:
            timer.stop()
        return self.forward_data_store

    # -- choosing -------------------------------------------------------------------------------------

    def _arrived(self, action):
        if action.kind == FORWARD:
            return self.layout.is_first(action.chunk) or self.inbox.has(FORWARD, action.chunk)
        return self.layout.is_last(action.chunk) or self.inbox.has(BACKWARD, action.chunk)

    def _choice(self):
        """The policy's answer now: an action, or None while nothing (it wants to run) is ready."""
        self.inbox.poll()
        candidates = self.progress.candidates()
        ready = [a for a in candidates if self._arrived(a)]
        return self.policy.choose(ready, candidates, self.progress.oldest_unfinished(), self.free_since,
                                  time.monotonic())

    def _next_action(self):
        if self.tp_size == 1:
            return self._wait_until(self._choice, self._awaited_inputs)
        if dist.get_rank() == self.tp_leader:
            action = self._wait_until(self._choice, self._awaited_inputs)
            decision = torch.tensor([_KINDS.index(action.kind), action.chunk, action.microbatch],
                                    dtype=torch.long, device=self.device)
        else:
            decision = torch.empty(3, dtype=torch.long, device=self.device)
        dist.broadcast(decision, src=self.tp_leader, group=self.tp_group)
        kind, chunk, microbatch = decision.tolist()
        action = Action(_KINDS[kind], chunk, microbatch)
        if action not in self.progress.candidates():  # TP ranks diverged: a bug, never a user error
            raise RuntimeError(f"DPP: tensor-parallel leader chose {action}, not a candidate here")
        self._wait_until(lambda: self.inbox.poll() or self._arrived(action),
                         lambda: self.inbox.describe_wait(*action))
        return action

    def _awaited_inputs(self):
        waiting = [self.inbox.describe_wait(*a) for a in self.progress.candidates() if not self._arrived(a)]
        return " or ".join(waiting) or "an action the policy would run"

    def _wait_until(self, condition, awaited):
        """Poll ``condition`` until it holds; past the stall timeout, stop naming ``awaited()``."""
        pause = _IDLE_SLEEP_S[0]
        started = time.monotonic()
        while not (result := condition()):
            time.sleep(pause)
            pause = min(pause * 2, _IDLE_SLEEP_S[1])
            timeout = self.schedule.stall_timeout
            if timeout is not None and time.monotonic() - started > timeout:
                raise PipelineStallError(
                    f"MegaDPP: rank {dist.get_rank()} (pipeline stage {self.layout.pp_rank}) waited "
                    f"{timeout:g} s for {awaited()}; that rank is stalled or dead (--dpp-timeout sets "
                    f"this limit)")
        return result

    def _wait(self, handle):
        phase, microbatch, chunk = handle.label
        self._wait_until(handle.is_completed,
                         lambda: f"its {phase} of microbatch {microbatch} (chunk {chunk}) to rank {handle.peer} "
                                 f"to complete")

    # -- running --------------------------------------------------------------------------------------

    def _forward(self, action):
        chunk, m = action.chunk, action.microbatch
        input_tensor = None
        if not self.layout.is_first(chunk):
            input_tensor = self.inbox.take(FORWARD, chunk)
            input_tensor.requires_grad_(not self.forward_only)
        output, tokens = forward_step(
            self.forward_step_func, self.data_iterator[chunk], self.model[chunk], self.microbatches,
            input_tensor, self.forward_data_store, self.config, parallel_state.get_context_parallel_world_size(),
            collect_non_loss_data=self.collect_non_loss_data,
            is_first_microbatch=check_first_val_step(self.first_val_step, self.forward_only, m == 0),
            current_microbatch=m, vp_stage=chunk if self.layout.chunks > 1 else None,
            is_last_stage=self.layout.is_last(chunk))
        self.total_tokens += tokens
        if not self.layout.is_last(chunk):
            self._send(action, output.detach(), *self.layout.downstream(chunk))
        if not self.forward_only:
            self.stash[(chunk, m)] = (input_tensor, output)
            deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)

    def _backward(self, action):
        chunk, m = action.chunk, action.microbatch
        input_tensor, output = self.stash.pop((chunk, m))
        output_grad = None if self.layout.is_last(chunk) else self.inbox.take(BACKWARD, chunk)
        input_grad = backward_step(input_tensor, output, output_grad, self.model_type, self.config)
        if not self.layout.is_first(chunk):
            self._send(action, input_grad, *self.layout.upstream(chunk))

    def _send(self, action, tensor, peer_rank, peer_chunk):
        """Send what ``action`` produced to the chunk that takes it."""
        channel = channel_of(action.kind, peer_chunk, self.layout.chunks)
        handle = self.schedule.transport.isend(tensor, self.pipeline_ranks[peer_rank], tag=channel)
        handle.label = TransferLabel(f"{_KIND_NAMES[action.kind]}-send", action.microbatch, action.chunk)
        self.sends.append(handle)

    # -- gradient and parameter synchronisation (as megatron-core's interleaved schedule) ---------------

    def _per_chunk(self, funcs):
        return funcs if isinstance(funcs, list) else [funcs] * len(self.model)

    def _start_param_sync(self):
        if self.config.param_sync_func is not None and self.layout.chunks > 1:
            for chunk, sync in zip(self.model, self._per_chunk(self.config.param_sync_func)):
                sync(chunk.parameters())

    def _finish_grad_sync(self):
        config = self.config
        if config.grad_sync_func is not None:
            for chunk, sync in zip(self.model, self._per_chunk(config.grad_sync_func)):
                sync(chunk.parameters())
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(
                self.model, self.total_tokens if config.calculate_per_token_loss else None)
