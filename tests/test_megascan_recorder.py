"""MegaScan's recorder with the trace writer, in one process: collectives that are only counted
(--trace-tp-microbatches) keep the sequence numbers, mark the records whose own work spans them, and a
stalled window's report names the last of them, once."""

import json
import time

from megascan.recorder import Recorder
from megascan.timing import HostTimer
from megascan.trace_writer import TraceWriter


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_skipped_collectives_keep_sequence_numbers_and_show_in_a_stall_report(tmp_path):
    recorder = Recorder(HostTimer())
    writer = TraceWriter(str(tmp_path / "trace.json"), {"type": "metadata"}, recorder)
    try:
        recorder.open_window(0, [1])
        recorder.begin_iteration(1)
        recorder.context.set_phase("forward", 0)
        first = recorder.add_op("allreduce", "collective", "tp0", "tp0", None, 8, "float32")
        recorder.end_ops([first])
        recorder.context.set_phase("forward", 1)
        recorder.skip_collective("allreduce", "tp0")
        recorder.skip_collective("_allgather_base", "tp0")
        send = recorder.add_op("send", "send", "pp0", ("pp0", "send", 1), 1, 8, "float32")
        recv = recorder.add_op("recv", "recv", "pp0", ("pp0", "recv", 1), 1, 8, "float32")
        after_skips = recorder.add_op("allreduce", "collective", "tp0", "tp0", None, 8, "float32")
        assert [r.unrecorded_before for r in (first, send, recv, after_skips)] == [0, 2, 2, 2]
        assert after_skips.seq == 3  # 0 recorded, 1 and 2 counted
        recorder.end_ops([send, recv])
        assert recorder.add_op("allreduce", "collective", "tp0", "tp0", None, 8, "float32").unrecorded_before == 0

        recorder.skip_collective("allreduce", "tp0")  # the rank then blocks in this one
        for _ in range(2):  # the second report has nothing new: the skipped one is not repeated
            recorder.window.opened_at = writer.last_line_at = time.monotonic() - 60
            writer._report_stalled_window()
    finally:
        writer.close()
    _, issued, again = _lines(tmp_path / "trace.json")
    assert [(op["op"], op["seq"]) for op in issued["ops"]] == [
        ("allreduce", 0), ("send", 0), ("recv", 0), ("allreduce", 3), ("allreduce", 4), ("allreduce", 5)]
    assert issued["ops"][-1]["unrecorded"] and issued["ops"][-1]["microbatch"] == 1
    assert again["ops"] == []
