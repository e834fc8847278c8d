"""Record every collective and point-to-point operation where it really happens: at the process group.

megatron-core reaches communication through ``torch.distributed`` functions, through functions it
bound at import time (``dist_all_gather_func``) and through coalescing managers; all of them end
in a method of ``torch.distributed.ProcessGroup``. While a trace window is open those methods are
replaced by recording wrappers; outside windows the originals are back and nothing is checked.

A wrapper records the op (group, sequence number, bytes, dtype, peer) and its start, and hands
back the Work wrapped so that the rank's ``wait()`` marks the end. Ops issued inside a coalesced
batch (``_start_coalescing`` .. ``_end_coalescing``, how NCCL batches p2p) end with the batch's Work.

Tensor parallelism issues about a hundred collectives per microbatch of a 24-layer model (two per layer
each way, ten a layer with sequence parallelism), and recording one costs the host 10-20 us on a GPU
(docs/benchmarks.md): 1.8-3.2 % of a host-bound iteration at eight microbatches. Those of the forward
passes of the last ``--trace-tp-microbatches`` microbatches of each iteration (and those outside
microbatches) are recorded; the rest pass almost untouched and are counted from the process group's own
sequence number (counted_collectives.py), which keeps every recorded one's sequence number equal to its
peers'. The last, not the first: an iteration starts with its GPU idle, so the host's launches pace the
first microbatch's forward, and whatever recording adds to the host there adds to the step; by the last
microbatch the host runs ahead of its GPU (70-80 ms in GPT 1.3B at TP2 + SP on four H200s) and recording
there uses slack. The forward only: with sequence parallelism a layer's backward issues six of its ten, and
a slow TP peer makes the other wait in the forward as much. Where it does shows in the recorded ones;
detection compares only the passes whose waits were recorded, and leaves out the own work that spans
unrecorded ones.
"""

import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_num_microbatches
from torch.distributed import ProcessGroup

from megascan.counted_collectives import CountedCollectives

# Methods whose first argument holds the input tensors; the rest take (outputs, inputs, ...).
_INPUT_FIRST = {"allreduce", "allreduce_coalesced", "broadcast", "reduce", "send", "recv", "barrier"}
COLLECTIVE_METHODS = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "barrier",
    "allgather", "allgather_coalesced", "_allgather_base", "allgather_into_tensor_coalesced",
    "all_gather_single", "all_gather_single_coalesced",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "alltoall", "alltoall_base", "all_to_all_single", "gather", "scatter",
)
P2P_METHODS = ("send", "recv")

_GROUP_ROLES = (  # megatron-core's groups, by the role a trace reader cares about
    ("tp", lambda: parallel_state.get_tensor_model_parallel_group()),
    ("pp", lambda: parallel_state.get_pipeline_model_parallel_group()),
    ("dp", lambda: parallel_state.get_data_parallel_group()),
    ("dp_cp", lambda: parallel_state.get_data_parallel_group(with_context_parallel=True)),
    ("mp", lambda: parallel_state.get_model_parallel_group()),
    ("embd", lambda: parallel_state.get_embedding_group()),
    ("pos_embd", lambda: parallel_state.get_position_embedding_group()),
)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


_DTYPE_NAMES: dict[torch.dtype, str] = {}  # torch.bfloat16 -> "bfloat16"


def size_and_dtype(method, args):
    inputs = args[0] if method in _INPUT_FIRST else (args[1] if len(args) > 1 else ())
    # one tensor: most of tensor parallelism's collectives, which a TP rank issues by the hundred
    tensors = (inputs,) if isinstance(inputs, torch.Tensor) else list(_tensors(inputs))
    nbytes = sum(t.nbytes for t in tensors)
    if not tensors:
        return nbytes, None
    dtype = tensors[0].dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return nbytes, name


class TracedWork:
    """A Work whose ``wait()`` also marks the end of the ops it completes."""

    __slots__ = ("_work", "_records", "_recorder")

    def __init__(self, work, records, recorder):
        self._work, self._records, self._recorder = work, records, recorder

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._recorder.end_ops(self._records)
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommTracer:
    def __init__(self, recorder, world=None, tp_microbatches=0):
        self.recorder = recorder
        self.world = world  # traced_world.TracedWorld: where this world's groups sit in the run; None: as they are
        # record the TP collectives of the forward passes of this many last microbatches; 0: all
        self.tp_microbatches = tp_microbatches
        self.groups = {}  # id(group) -> (group, its name, global ranks, role); holding the group keeps its id unique
        self.coalescing = {}  # group name -> records issued inside an open coalesced batch
        self.originals = {}
        # Built at the first install and reused: making them at every traced iteration left a few hundred
        # closures and cells alive through its collections, which the garbage collector moved to its oldest
        # generation, bringing its full collections (hundreds of milliseconds in a process holding a model)
        # sooner (docs/benchmarks.md).
        self.wrappers = None
        self.roles = {}
        self.tp_group = None  # the TP group, where some of its collectives are only counted

    def install(self):
        if not self.roles:
            self.roles = {id(dist.group.WORLD): "world"}
            for role, getter in reversed(_GROUP_ROLES):  # reversed: the first role of a shared group wins
                group = _group_or_none(getter)
                if group is not None:
                    self.roles[id(group)] = role
            if self.tp_microbatches:
                self.tp_group = _group_or_none(parallel_state.get_tensor_model_parallel_group)
        self._start_counting()
        if self.wrappers is None:
            self.wrappers = self._wrap_methods()
        for name, wrapper in self.wrappers.items():
            # The class's own descriptor, not getattr's unwrapped function: only the descriptor
            # binds ``self`` again once it is put back.
            self.originals[name] = ProcessGroup.__dict__.get(name)
            setattr(ProcessGroup, name, wrapper)

    def _wrap_methods(self):
        counted_id = None if self.tp_group is None else id(self.tp_group)
        wrappers = {name: self._traced(name, getattr(ProcessGroup, name), counted_id)
                    for name in COLLECTIVE_METHODS + P2P_METHODS if hasattr(ProcessGroup, name)}
        wrappers["_start_coalescing"] = self._start_coalescing(ProcessGroup._start_coalescing)
        wrappers["_end_coalescing"] = self._end_coalescing(ProcessGroup._end_coalescing)
        return wrappers

    def _start_counting(self):
        """Start the window's CountedCollectives for this iteration, unless all are recorded."""
        if self.tp_group is None:
            return
        recorder = self.recorder
        counted = recorder.counted
        if counted is None:
            counted = recorder.counted = CountedCollectives.of(recorder, self.tp_group, self._known(self.tp_group)[1])
            if counted is None:  # its backend numbers nothing: record them all from now on
                self.tp_group = None
                return
        else:
            counted.restart()
        context = recorder.context
        # per traced iteration: a batch-size ramp-up changes the number of microbatches
        context.first_recorded = max(get_num_microbatches() - self.tp_microbatches, 0)
        context.backward_counted, context.on_counting = True, counted.moved

    def uninstall(self):
        context = self.recorder.context
        if context.counting:
            self.recorder.counted.fold()
        context.first_recorded, context.backward_counted, context.counting, context.on_counting = 0, False, False, None
        for name, original in self.originals.items():
            if original is None:
                delattr(ProcessGroup, name)
            else:
                setattr(ProcessGroup, name, original)
        self.originals = {}
        self.coalescing = {}

    def _known(self, group):
        """(group, its name, global ranks, role), cached by id: asking a group for its name costs a C++ call."""
        known = self.groups.get(id(group))
        if known is None:
            name, ranks = group.group_name, dist.get_process_group_ranks(group)
            if self.world is not None:
                name, ranks = self.world.group_prefix + name, self.world.global_ranks(ranks)
            known = self.groups[id(group)] = (group, name, ranks, self.roles.get(id(group), "other"))
        return known

    def _group(self, group):
        _, name, ranks, role = self._known(group)
        window_groups = self.recorder.window.groups
        if name not in window_groups:
            window_groups[name] = {"ranks": ranks, "role": role}
        return name, ranks

    def _traced(self, method, original, counted_id):
        """``counted_id``: the id of the group whose collectives may be only counted (context.counting says
        when: then the recorder holds the window's CountedCollectives), or None."""
        recorder = self.recorder
        context = recorder.context
        kind = method if method in P2P_METHODS else "collective"
        # The fast path (counted_collectives.py): as little as can be, since hundreds pass per microbatch.
        if kind != "collective":
            counted_id = None
        clock = time.time_ns

        def traced(group, *args, **kwargs):
            if context.counting:
                if id(group) == counted_id:
                    recorder.counted.latest = (method, context.iteration, context.microbatch, context.chunk,
                                               context.phase, clock())
                    return original(group, *args, **kwargs)
                recorder.counted.fold()  # recorded among counted ones: its counters and unrecorded_before are due
            name, ranks = self._group(group)
            nbytes, dtype = size_and_dtype(method, args)
            if kind == "collective":
                record = recorder.add_op(method, kind, name, name, None, nbytes, dtype)
            else:
                peer = ranks[args[1]]
                record = recorder.add_op(method, kind, name, (name, kind, peer), peer, nbytes, dtype)
            work = original(group, *args, **kwargs)
            if name in self.coalescing:
                self.coalescing[name].append(record)
                return work
            if work is None:  # the backend completed it in stream order already (NCCL, async_op=False)
                recorder.end_ops([record])
                return work
            return TracedWork(work, [record], recorder)

        return traced

    def _start_coalescing(self, original):
        def start(group, *args, **kwargs):
            self.coalescing[self._known(group)[1]] = []  # the name its ops are recorded under
            return original(group, *args, **kwargs)

        return start

    def _end_coalescing(self, original):
        def end(group, *args, **kwargs):
            records = self.coalescing.pop(self._known(group)[1], [])
            work = original(group, *args, **kwargs)
            return TracedWork(work, records, self.recorder) if work is not None and records else work

        return end


def _group_or_none(getter):
    try:
        return getter()
    except (AssertionError, RuntimeError):  # a group megatron-core did not create in this layout
        return None
