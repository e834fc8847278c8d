"""MegaScan's recorder with the trace writer, in one process: collectives that are only counted
(--trace-tp-microbatches), through a real gloo group's own sequence numbers, keep the recorded ones'
numbers, mark the records whose own work spans them, and a stalled window's report names the last of
them, once."""

import json
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
from torch.distributed import ProcessGroup

from megascan.comm_tracer import CommTracer
from megascan.counted_collectives import CountedCollectives
from megascan.recorder import Recorder
from megascan.timing import HostTimer
from megascan.trace_writer import TraceWriter


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _pass(counted, context, op, group):
    """What the wrapper's fast path does with a counted collective: note it and run it."""
    counted.latest = (op, context.iteration, context.microbatch, context.chunk, context.phase, time.time_ns())
    group.allreduce([torch.ones(2)]).wait()


def test_skipped_collectives_keep_sequence_numbers_and_show_in_a_stall_report(tmp_path):
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    recorder = Recorder(HostTimer())
    writer = TraceWriter(str(tmp_path / "trace.json"), {"type": "metadata"}, recorder)
    context = recorder.context
    try:
        recorder.open_window(0, [1])
        recorder.begin_iteration(1)
        counted = recorder.counted = CountedCollectives(recorder, group, "tp0")
        context.first_recorded, context.on_counting = 2, counted.moved
        context.set_phase("forward", 2)
        first = recorder.add_op("allreduce", "collective", "tp0", "tp0", None, 8, "float32")
        group.allreduce([torch.ones(2)]).wait()  # recorded: numbered by the recorder, not counted again below
        recorder.end_ops([first])
        context.set_phase("forward", 1)
        assert context.counting
        _pass(counted, context, "allreduce", group)
        _pass(counted, context, "_allgather_base", group)
        counted.fold()  # what the wrapper does before recording a transfer among counted collectives
        send = recorder.add_op("send", "send", "pp0", ("pp0", "send", 1), 1, 8, "float32")
        recv = recorder.add_op("recv", "recv", "pp0", ("pp0", "recv", 1), 1, 8, "float32")
        context.set_phase("forward", 2)  # leaving folds again: nothing passed since
        after_skips = recorder.add_op("allreduce", "collective", "tp0", "tp0", None, 8, "float32")
        group.allreduce([torch.ones(2)]).wait()
        assert [r.unrecorded_before for r in (first, send, recv, after_skips)] == [0, 2, 2, 2]
        assert after_skips.seq == 3  # 0 recorded, 1 and 2 counted
        recorder.end_ops([send, recv])
        assert recorder.add_op("allreduce", "collective", "tp0", "tp0", None, 8, "float32").unrecorded_before == 0
        group.allreduce([torch.ones(2)]).wait()

        context.set_phase("backward", 0)
        _pass(counted, context, "allreduce", group)  # the rank then blocks in this one, before any fold
        for _ in range(2):  # the second report has nothing new: the skipped one is not repeated
            recorder.window.opened_at = writer.last_line_at = time.monotonic() - 60
            writer._report_stalled_window()
    finally:
        writer.close()
    _, issued, again = _lines(tmp_path / "trace.json")
    assert [(op["op"], op["seq"]) for op in issued["ops"]] == [
        ("allreduce", 0), ("send", 0), ("recv", 0), ("allreduce", 3), ("allreduce", 4), ("allreduce", 5)]
    assert issued["ops"][-1]["unrecorded"] and issued["ops"][-1]["microbatch"] == 0
    assert again["ops"] == []


def test_a_stall_after_the_fold_names_the_folded_number():
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    recorder = Recorder(HostTimer())
    recorder.open_window(0, [1])
    counted = recorder.counted = CountedCollectives(recorder, group, "tp0")
    recorder.context.first_recorded, recorder.context.on_counting = 1, counted.moved
    recorder.context.set_phase("forward", 0)
    for op in ("allreduce", "_reduce_scatter_base", "_allgather_base"):
        _pass(counted, recorder.context, op, group)
    recorder.context.set_phase("forward", 1)
    group.allreduce([torch.ones(2)]).wait()  # recorded after the fold
    recorder.add_op("allreduce", "collective", "tp0", "tp0", None, 8, "float32")
    fields = recorder.last_unrecorded_fields()
    assert (fields["op"], fields["seq"], fields["microbatch"]) == ("_allgather_base", 2, 0)


def test_backward_passes_are_counted_in_every_microbatch_where_asked():
    context = Recorder(HostTimer()).context
    heard = []
    context.first_recorded, context.on_counting = 1, heard.append
    steps = (("forward", 0), ("forward", 1), ("loss", 1), ("backward", 1), ("iteration", None), ("backward", 0))

    def counting_along(steps):
        states = []
        for phase, microbatch in steps:
            context.set_phase(phase, microbatch)
            states.append(context.counting)
        return states

    assert counting_along(steps) == [True, False, False, False, False, True]
    context.backward_counted = True
    assert counting_along(steps) == [True, False, False, True, False, True]
    assert heard == [True, False, True, False, True, False, True]  # each change, once


def test_a_backend_without_sequence_numbers_is_not_counted():
    numberless = FakeProcessGroup._create_internal(0, 2)  # PyTorch's own "fake" backend keeps none
    assert CountedCollectives.of(Recorder(HostTimer()), numberless, "tp0") is None


def test_the_process_group_wrappers_are_made_once_and_the_originals_put_back_each_time():
    """Wrappers made at each traced iteration were garbage that the collector moved to its oldest generation."""
    originals = {name: ProcessGroup.__dict__[name] for name in ("allreduce", "_allgather_base", "_end_coalescing")}
    tracer = CommTracer(Recorder(HostTimer()))
    installed = []
    for _ in range(2):
        tracer.install()
        installed.append({name: ProcessGroup.__dict__[name] for name in originals})
        tracer.uninstall()
        assert {name: ProcessGroup.__dict__[name] for name in originals} == originals
    assert installed[0] == installed[1]
    assert all(installed[0][name] is not original for name, original in originals.items())
