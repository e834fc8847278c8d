"""tools/aggregate.py: synthetic per-rank trace directories (megascan/simulation/synthetic_traces.py) with known ground
truth are matched, aligned and merged exactly; damaged directories are reported and the rest merged;
the outputs (Chrome trace, SQLite) hold what they should; bad command lines stop with one line."""

import concurrent.futures
import dataclasses
import json
import os
import random
import sqlite3
import subprocess
import sys

import pytest
from helpers.launch import REPO

from megascan.aggregate import load_and_merge
from megascan.aggregate.chrome_trace import write_chrome_trace
from megascan.aggregate.sqlite_export import write_sqlite
from megascan.aggregate.trace_records import ComputeEvent
from megascan.aggregate.trace_subset import spans_text
from megascan.aggregate_cli import main
from megascan.detection import detect
from megascan.detection.compute import KnownTpWaits, operation_totals, tp_waits_known
from megascan.simulation.synthetic_traces import op_key, read_lines, write_lines, write_run

# DP2 x PP2 x TP2, 4 layers, 4 microbatches, windows (4, 5) and (9, 10). Per iteration: 4 TP all-reduces
# per layer and microbatch on each of 4 TP groups (2 layers per stage), one gradient all-reduce on each
# of 4 DP groups, one embedding all-reduce on each of 4 first/last-stage pairs, one grad-norm all-reduce
# on each of 2 model-parallel groups; and per microbatch one activation and one gradient transfer on
# each of 4 pipeline links... counted over 4 iterations:
COLLECTIVES = 4 * (4 * 2 * 4 * 4 + 4 + 4 + 2)
TRANSFERS = 4 * 4 * 2 * 4
ALIGNMENT_TOLERANCE_US = 3.0  # finishes jitter by 0.5 us per rank; alignment must not add more than this
TRANSFER_US_BOUND = 120.0  # a synthetic pipeline transfer, from send issue to recv completion, at most


def _strip_collectives(path):
    metadata, *lines = read_lines(path)
    for line in lines:
        line["ops"] = [op for op in line["ops"] if op["kind"] != "collective"]
    write_lines(path, [metadata] + lines)


def test_every_collective_and_transfer_is_matched_to_its_true_operation(tmp_path):
    run = write_run(tmp_path, superseded_issued=True)
    merged = load_and_merge(tmp_path)
    assert merged.problems == [] and merged.unaligned == {} and sorted(merged.ranks) == list(range(8))
    kinds = [instance.kind for instance in merged.instances]
    assert (kinds.count("collective"), kinds.count("p2p")) == (COLLECTIVES, TRANSFERS)
    operations = run.operations()
    assert len(merged.instances) == len(operations)
    assert [instance.id for instance in merged.instances] == list(range(len(merged.instances)))
    for instance in merged.instances:
        truths = {run.truth[op_key(rank, {key: getattr(record, key) for key in ("group", "kind", "peer", "seq")})]
                  for rank, record in instance.records.items()}
        assert len(truths) == 1, instance  # one true operation per instance ...
        assert set(instance.records) == operations[truths.pop()] == set(instance.participants)  # ... all of it
        assert instance.missing == [] and not any(r.issued_only for r in instance.records.values())
        if instance.kind == "p2p":
            assert instance.records[instance.src].kind == "send" and instance.records[instance.dst].kind == "recv"
    trace = merged.rank_at(dp=1, pp=0, tp=1)
    assert trace.rank == run.rank(1, 0, 1) and trace.windows == [0, 1] and trace.iterations == [4, 5, 9, 10]
    assert not trace.issued_only and len(trace.nvml) == 2 and trace.nvml[0][0] == 0


def test_injected_clock_offsets_and_drift_are_recovered(tmp_path):
    rng = random.Random(5)
    # Offsets far beyond what NTP leaves (up to 20 ms), drift up to 40 ppm; rank 0 is the reference.
    clocks = {rank: (1 + rng.uniform(-40e-6, 40e-6), rng.uniform(-20_000.0, 20_000.0)) for rank in range(1, 16)}
    run = write_run(tmp_path, dp=4, clocks=clocks)
    merged = load_and_merge(tmp_path)
    assert merged.problems == [] and merged.reference_rank == 0
    worst = 0.0
    for rank, trace in merged.ranks.items():
        assert trace.clock.drift_ppm == pytest.approx((clocks.get(rank, (1.0, 0))[0] - 1) * 1e6, abs=3.0)
        for event in trace.events:
            worst = max(worst, abs(event.start - run.to_global(rank, event.start_us)),
                        abs(event.end - run.to_global(rank, event.end_us)))
    for instance in merged.instances:
        for rank, record in instance.records.items():
            worst = max(worst, abs(record.end - run.to_global(rank, record.end_us)))
    assert worst < ALIGNMENT_TOLERANCE_US
    # The files' own clocks are milliseconds apart, so merging without alignment would fail this test.
    assert max(abs(offset) for _, offset in clocks.values()) > 1000 * ALIGNMENT_TOLERANCE_US


LATE_RETURN_US = 600.0  # far more than a transfer takes (TRANSFER_US = 80 us in the synthetic traces)


def _returns_late_from_collectives(path):
    """The rank returns from every collective LATE_RETURN_US after it completed (a descheduled host
    thread under gloo): the fit, which takes finishes as simultaneous, puts its clock that much early."""
    metadata, *lines = read_lines(path)
    for line in lines:
        for op in line["ops"]:
            if op["kind"] == "collective":
                op["end_us"] += LATE_RETURN_US
    write_lines(path, [metadata] + lines)


def _backwards(merged):
    """Transfers whose recv completes before the send was issued, and collective finishes before the
    last member issued it, on the merged clocks."""
    found = []
    for instance in merged.instances:
        if instance.kind == "p2p":
            if instance.records[instance.dst].end < instance.records[instance.src].start:
                found.append(instance)
        elif min(r.end for r in instance.records.values()) < max(r.start for r in instance.records.values()):
            found.append(instance)
    return found


def _merged_run_and_its_chrome_trace(tmp_path):
    """A synthetic run written, merged and written as a Chrome trace: (merged trace, its trace events)."""
    write_run(tmp_path)
    merged = load_and_merge(tmp_path)
    write_chrome_trace(merged, tmp_path / "benchmark.json")
    return merged, json.loads((tmp_path / "benchmark.json").read_text())["traceEvents"]


def _flow_pairs_in(path):
    events = json.loads(path.read_text())["traceEvents"]
    starts = {e["id"]: e["ts"] for e in events if e["ph"] == "s"}
    return [(starts[e["id"]], e["ts"]) for e in events if e["ph"] == "f"]


def test_clocks_are_corrected_so_that_nothing_runs_backwards(tmp_path, capsys):
    rng = random.Random(7)
    clocks = {rank: (1 + rng.uniform(-20e-6, 20e-6), rng.uniform(-20_000.0, 20_000.0)) for rank in range(1, 8)}
    run = write_run(tmp_path, clocks=clocks)
    _returns_late_from_collectives(run.path(3))
    merged = load_and_merge(tmp_path)
    check = merged.causality
    assert check.backwards > 0 and check.remaining == 0 and _backwards(merged) == []
    # Rank 3 alone moves later, at least as far as its transfers need (the fit had it LATE_RETURN_US early,
    # its transfers take less than TRANSFER_US_BOUND), and no further than its collectives allow.
    assert list(check.shifts_us) == [3] and check.shifts_us[3] > LATE_RETURN_US - 2 * TRANSFER_US_BOUND
    event = merged.ranks[3].events[0]
    assert 0 < run.to_global(3, event.start_us) - event.start < LATE_RETURN_US - check.shifts_us[3] + 1.0
    write_chrome_trace(merged, tmp_path / "merged.json")
    flows = _flow_pairs_in(tmp_path / "merged.json")
    assert len(flows) == TRANSFERS + sum(len(i.records) - 1 for i in merged.instances if i.kind == "collective")
    assert all(finish >= start for start, finish in flows)
    assert main(["-b", str(tmp_path), "-o", str(tmp_path / "cli.json")]) == 0
    assert (f"causality: {check.backwards} of {check.checked} transfers and collective finishes ran backwards "
            f"after the fit; shifted ranks ") in capsys.readouterr().out


def test_a_contradictory_transfer_is_counted_and_its_flow_left_out(tmp_path, capsys):
    run = write_run(tmp_path)
    metadata, *lines = read_lines(run.path(2))
    recv = next(op for op in lines[0]["ops"] if op["kind"] == "recv")
    recv["end_us"] = recv["start_us"] - 5_000.0  # completes long before anyone sent it: no clock explains that
    write_lines(run.path(2), [metadata] + lines)
    merged = load_and_merge(tmp_path)
    assert (merged.causality.backwards, merged.causality.remaining, merged.causality.shifts_us) == (1, 1, {})
    write_chrome_trace(merged, tmp_path / "merged.json")
    flows = _flow_pairs_in(tmp_path / "merged.json")
    assert all(finish >= start for start, finish in flows)
    assert len(flows) == TRANSFERS - 1 + sum(len(i.records) - 1 for i in merged.instances if i.kind == "collective")
    assert main(["-b", str(tmp_path), "-o", str(tmp_path / "cli.json")]) == 0
    assert "1 remain(s) (the traces contradict themselves there" in capsys.readouterr().out


def test_chrome_trace_lists_ranks_in_layout_order_with_the_same_tracks_as_perfetto_orders_them(tmp_path):
    # What the Perfetto UI (v52) does with the file, checked by hand (docs/megascan_aggregate.md): it
    # orders processes by activity, whatever their sort index, and the threads of a process by tid; it
    # lists the thread whose tid is the pid first, as the main thread, and moves tid 0's slices onto it.
    _, events = _merged_run_and_its_chrome_trace(tmp_path)
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == [
        "MegaScan run 20261122-051355-3fa2c1 (DP2 x PP2 x TP2)"]
    pid = events[0]["pid"]
    assert {e["pid"] for e in events} == {pid}
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert 0 not in threads and pid not in threads
    assert {e["tid"]: e["args"]["sort_index"] for e in events if e["name"] == "thread_sort_index"} == {
        tid: tid for tid in threads}
    label = [name.split(") ")[0] + ")" for _, name in sorted(threads.items())]
    assert list(dict.fromkeys(label)) == [  # DP, then PP, then TP
        "DP0-PP0-TP0 (rank 0)", "DP0-PP0-TP1 (rank 1)", "DP0-PP1-TP0 (rank 4)", "DP0-PP1-TP1 (rank 5)",
        "DP1-PP0-TP0 (rank 2)", "DP1-PP0-TP1 (rank 3)", "DP1-PP1-TP0 (rank 6)", "DP1-PP1-TP1 (rank 7)"]
    tracks = {}
    for _tid, name in sorted(threads.items()):
        rank_label, track = name.split(") ", 1)
        tracks.setdefault(rank_label, []).append(track)
    assert all(names == ["compute", "compute (depth 1)", "compute (depth 2)", "collectives", "p2p"]
               for names in tracks.values()), tracks


def test_chrome_trace_has_separate_tracks_and_paired_flows(tmp_path):
    merged, events = _merged_run_and_its_chrome_trace(tmp_path)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    slices = [e for e in events if e["ph"] == "X"]
    assert min(e["ts"] for e in slices) == 0.0
    by_track = {}
    for e in slices:
        family = threads[e["pid"], e["tid"]].split(") ")[1].split()[0]
        assert family == {"compute": "compute", "collective": "collectives", "p2p": "p2p"}[e["cat"]]
        by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():  # no track holds overlapping slices
        spans.sort()
        assert all(end <= next_start + 1e-6 for (_, end), (next_start, _) in zip(spans, spans[1:]))
    layer = next(e for e in slices if e["name"] == "mlp-forward")
    assert {"iteration", "microbatch", "chunk", "layer"} <= set(layer["args"])
    send = next(e for e in slices if e["cat"] == "p2p" and e["name"].startswith("send"))
    assert send["args"]["bandwidth_GBps"] == pytest.approx(send["args"]["bytes"] / send["dur"] / 1e3, rel=1e-3)
    assert {"instance", "role", "seq", "bytes", "dtype", "phase"} <= set(send["args"])
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts.keys() == finishes.keys()
    # A flow per transfer, and per collective one from the last arrival to each other member.
    assert len(starts) == TRANSFERS + sum(len(i.records) - 1 for i in merged.instances if i.kind == "collective")
    for flow_id, start in starts.items():
        finish = finishes[flow_id]
        assert (start["name"], start["cat"]) == (finish["name"], finish["cat"]) and finish["bp"] == "e"
        for point in (start, finish):  # each end lies inside a slice of its track, which it binds to
            assert any(a <= point["ts"] <= b for a, b in by_track[point["pid"], point["tid"]]), point


def test_missing_rank_file_is_named_and_the_rest_merged(tmp_path):
    run = write_run(tmp_path)
    os.remove(run.path(5))
    merged = load_and_merge(tmp_path)
    assert sorted(merged.ranks) == [0, 1, 2, 3, 4, 6, 7]
    missing = [p for p in merged.problems if "DP0-PP1-TP1" in p]
    assert len(missing) == 1 and "benchmark-data-0-pipeline-1-tensor-1.json: no such file" in missing[0]
    assert any("no trace for rank 5 of world size 8" in p for p in merged.problems)
    assert len(merged.instances) == len(run.operations())  # every operation had another member
    assert all(5 not in i.records and 5 not in i.missing for i in merged.instances)


def test_cut_last_line_and_file_without_metadata_are_skipped_and_said(tmp_path):
    run = write_run(tmp_path)
    data = open(run.path(3), "rb").read()
    open(run.path(3), "wb").write(data[:len(data) - 5000])  # killed while writing its last window line
    open(run.path(6), "w").write('{"type": "metad')
    merged = load_and_merge(tmp_path)
    assert any("benchmark-data-1-pipeline-0-tensor-1.json: last line cut off" in p for p in merged.problems)
    assert any("benchmark-data-1-pipeline-1-tensor-0.json: no valid metadata line" in p for p in merged.problems)
    assert sorted(merged.ranks) == [0, 1, 2, 3, 4, 5, 7] and merged.ranks[3].iterations == [4, 5]
    unequal = [p for p in merged.problems if p.startswith("unequal traced iterations")]
    assert len(unequal) == 1 and "rank 3 have 2" in unequal[0] and "iterations 9, 10" in unequal[0]
    # Rank 3 never recorded window 1: its partners there find it missing.
    partner_of_3 = [i for i in merged.instances if 2 in i.records and i.role == "tp" and i.iteration == 9]
    assert partner_of_3 and all(i.missing == [3] for i in partner_of_3)


def test_detection_names_the_ranks_it_could_not_judge_beside_its_verdict(tmp_path, capsys):
    run = write_run(tmp_path)
    os.remove(run.path(5))  # DP0-PP1-TP1: no file
    _strip_collectives(run.path(6))  # DP1-PP1-TP0: shares no collective, so on an unknown clock
    report = detect(load_and_merge(tmp_path))
    assert report.suspects == [] and report.unjudged == [
        {"who": "DP0-PP1-TP1", "why": "no usable trace (benchmark-data-0-pipeline-1-tensor-1.json: no such file)"},
        {"who": "rank 6", "why": "not aligned, so not merged: shares no collective with rank 0 or the ranks aligned "
                                 "to it"}]
    assert main(["-b", str(tmp_path), "-d"]) == 0
    text = capsys.readouterr().out
    assert text[text.index("MegaScan detection"):].splitlines()[:4] == [
        "MegaScan detection: no suspect among the 6 ranks judged (no rank is slow, no link is slow, no rank hung).",
        "Not judged (no verdict on them):",
        "   DP0-PP1-TP1: no usable trace (benchmark-data-0-pipeline-1-tensor-1.json: no such file)",
        "   rank 6: not aligned, so not merged: shares no collective with rank 0 or the ranks aligned to it"]


def test_detection_says_which_iterations_a_cut_trace_leaves_unjudged(tmp_path):
    run = write_run(tmp_path)
    data = open(run.path(3), "rb").read()
    open(run.path(3), "wb").write(data[:len(data) - 5000])  # killed while writing its last window line
    assert detect(load_and_merge(tmp_path)).unjudged == [
        {"who": "rank 3 (DP1-PP0-TP1)", "why": "its trace ends early (cut off): no verdict on it for iterations 9, 10"}]


def test_window_line_with_an_unusable_op_is_skipped_and_said(tmp_path):
    run = write_run(tmp_path)
    metadata, first, second = read_lines(run.path(1))
    del first["ops"][7]["seq"]
    write_lines(run.path(1), [metadata, first, second])
    merged = load_and_merge(tmp_path)
    assert any(p.startswith("benchmark-data-0-pipeline-0-tensor-1.json: line 2 has an op record without")
               for p in merged.problems)
    assert merged.ranks[1].iterations == [9, 10] and merged.ranks[0].iterations == [4, 5, 9, 10]


def test_files_of_another_run_are_ignored_and_named(tmp_path):
    run = write_run(tmp_path / "trace")
    other = write_run(tmp_path / "other", dp=4, run_id="20261121-000000-000000")
    for rank in range(other.world_size):
        if other.coords(rank)["dp"] == 3:
            os.rename(other.path(rank), tmp_path / "trace" / os.path.basename(other.path(rank)))
    merged = load_and_merge(tmp_path / "trace")
    assert merged.run_id == run.run_id and sorted(merged.ranks) == list(range(8))
    ignored = [p for p in merged.problems if "20261121-000000-000000" in p]
    assert len(ignored) == 1 and "4 file(s) of another run" in ignored[0]
    assert "benchmark-data-3-pipeline-0-tensor-0.json" in ignored[0]


def test_ranks_with_fewer_iterations_are_named(tmp_path):
    run = write_run(tmp_path)
    for rank in (6, 7):
        write_lines(run.path(rank), read_lines(run.path(rank))[:-1])
    merged = load_and_merge(tmp_path)
    assert merged.problems == ["unequal traced iterations: ranks 6, 7 have 2 (1 window(s)) where others have 4; "
                               "missing iterations 9, 10"]
    assert sorted(merged.ranks) == list(range(8)) and merged.ranks[6].iterations == [4, 5]


def test_rank_sharing_no_collective_is_unaligned_and_not_merged(tmp_path):
    run = write_run(tmp_path)
    _strip_collectives(run.path(5))
    merged = load_and_merge(tmp_path)
    assert list(merged.unaligned) == [5] and "shares no collective with rank 0" in merged.unaligned[5]
    assert 5 not in merged.ranks and all(5 not in i.records for i in merged.instances)
    assert any(p.startswith("rank 5 (DP0-PP1-TP1) not aligned, so not merged") for p in merged.problems)


def test_host_clock_rank_on_the_reference_host_needs_no_collective(tmp_path):
    # As MegaFBD's CPU forward instances beside GPU backward instances: a host timer on rank 0's host reads the
    # wall clock that rank 0's CUDA events are anchored to.
    run = write_run(tmp_path)
    _strip_collectives(run.path(5))
    metadata, *lines = read_lines(run.path(5))
    write_lines(run.path(5), [{**metadata, "timer": "host_clock"}] + lines)
    merged = load_and_merge(tmp_path)
    assert merged.unaligned == {} and 5 in merged.ranks and merged.ranks[5].clock.rate == 1.0


def test_single_rank_is_its_own_reference(tmp_path):
    write_run(tmp_path, dp=1, pp=1, tp=1)
    merged = load_and_merge(tmp_path)
    assert merged.reference_rank == 0 and merged.problems == [] and merged.instances == []
    assert all(e.start == e.start_us and e.end == e.end_us for e in merged.ranks[0].events)


def test_stalled_window_keeps_what_each_rank_issued(tmp_path):
    run = write_run(tmp_path, hang_rank=2)
    merged = load_and_merge(tmp_path)
    assert all(trace.issued_only and trace.windows == [0, 1] and trace.iterations == [4, 5]
               for trace in merged.ranks.values())
    stuck = [i for i in merged.instances if i.missing]
    assert stuck and all(i.missing == [2] for i in stuck)  # only the hung rank never issued ops others did
    first = min(stuck, key=lambda i: min(r.start for r in i.records.values()))
    assert first.role == "tp" and first.iteration == 9 and list(first.records) == [3]
    record = first.records[3]
    assert record.issued_only and record.end is None
    # Host time on the global clock: the fit of window 0 extrapolated to window 1 (clocks agree, truly).
    assert record.start == pytest.approx(record.host_us, abs=10.0)
    assert sum(len(i.records) for i in merged.instances) == len(run.truth)  # both issued lines, every op once


def test_sqlite_tables_hold_ranks_events_and_ops(tmp_path):
    write_run(tmp_path)
    merged = load_and_merge(tmp_path)
    write_sqlite(merged, tmp_path / "trace.db")
    db = sqlite3.connect(tmp_path / "trace.db")
    assert db.execute("SELECT rank, dp, pp, tp, device_name FROM ranks WHERE rank = 6").fetchone() == (
        6, 1, 1, 0, "NVIDIA H200")
    assert db.execute("SELECT COUNT(*) FROM events").fetchone()[0] == sum(len(t.events) for t in merged.ranks.values())
    assert db.execute("SELECT COUNT(*) FROM ops").fetchone()[0] == sum(len(i.records) for i in merged.instances)
    transfer = next(i for i in merged.instances if i.kind == "p2p")
    rows = db.execute("SELECT rank, kind, peer, end_us - start_us FROM ops WHERE instance_id = ? ORDER BY kind DESC",
                      (transfer.id,)).fetchall()
    assert [(rank, kind, peer) for rank, kind, peer, _ in rows] == [
        (transfer.src, "send", transfer.dst), (transfer.dst, "recv", transfer.src)]
    assert all(duration > 0 for *_, duration in rows)
    layers = db.execute("SELECT COUNT(*) FROM events WHERE name = 'mlp-backward' AND layer = 3").fetchone()[0]
    assert layers == 4 * 4 * 4  # 4 ranks of stage 1 x 4 microbatches x 4 iterations


def test_cli_writes_outputs_atomically_and_summarises(tmp_path, capsys):
    write_run(tmp_path / "trace")
    assert main(["--bench-dir", str(tmp_path / "trace"), "--sqlite", str(tmp_path / "out.db")]) == 0
    out = capsys.readouterr().out
    assert "ranks: 8 merged of 8 loaded (all aligned)" in out
    assert f"instances matched: {COLLECTIVES + TRANSFERS} ({COLLECTIVES} collective, {TRANSFERS} p2p)" in out
    assert "alignment residual per rank: max" in out and str(tmp_path / "trace" / "benchmark.json") in out
    # No temporary file left behind, no input touched.
    assert sorted(os.listdir(tmp_path)) == ["out.db", "trace"] and len(os.listdir(tmp_path / "trace")) == 9
    assert json.loads((tmp_path / "trace" / "benchmark.json").read_text())["otherData"]["reference_rank"] == 0


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_cli_outputs_follow_the_umask(tmp_path, umask):
    # On a shared cluster teammates open the merged trace and the report: their mode is the user's
    # usual one (0666 less the umask), not the 0600 of a temporary file.
    write_run(tmp_path / "trace")
    outputs = [tmp_path / "merged.json", tmp_path / "trace.db", tmp_path / "report.json"]
    previous = os.umask(umask)
    try:
        assert main(["-b", str(tmp_path / "trace"), "-o", str(outputs[0]), "--sqlite", str(outputs[1]),
                     "--report-json", str(outputs[2])]) == 0
    finally:
        os.umask(previous)
    assert {path.name: oct(path.stat().st_mode & 0o777) for path in outputs} == {
        path.name: oct(0o666 & ~umask) for path in outputs}


def test_cli_detection_report_json(tmp_path, capsys):
    pytest.importorskip("megascan.detection")
    write_run(tmp_path)
    assert main(["-b", str(tmp_path), "-o", str(tmp_path / "merged.json"), "--report-json",
                 str(tmp_path / "report.json")]) == 0
    assert "MegaScan detection" in capsys.readouterr().out
    assert isinstance(json.loads((tmp_path / "report.json").read_text()), dict)


def _rank_of_track(events):
    """Thread id -> rank, from the track names ("DP0-PP1-TP0 (rank 4) compute")."""
    return {e["tid"]: int(e["args"]["name"].split("(rank ")[1].split(")")[0])
            for e in events if e["name"] == "thread_name"}


def test_cli_writes_a_part_of_the_timeline(tmp_path, capsys):
    write_run(tmp_path / "trace")
    assert main(["-b", str(tmp_path / "trace"), "-o", str(tmp_path / "full.json")]) == 0
    assert main(["-b", str(tmp_path / "trace"), "-o", str(tmp_path / "part.json"), "--ranks", "0-1,5",
                 "--iterations", "9"]) == 0
    assert "Chrome trace (ranks 0, 1, 5 of 8, iteration 9)" in capsys.readouterr().out
    traces = {name: json.loads((tmp_path / name).read_text())["traceEvents"] for name in ("full.json", "part.json")}
    rank_of = {name: _rank_of_track(events) for name, events in traces.items()}
    full, part = ({e.get("args", {}).get("instance"): e for e in traces[name]
                   if e["ph"] == "X" and e["cat"] != "compute" and rank_of[name][e["tid"]] == 5}
                  for name in ("full.json", "part.json"))
    events = traces["part.json"]
    assert set(rank_of["part.json"].values()) == {0, 1, 5}
    assert {e["args"]["iteration"] for e in events if e["ph"] == "X"} == {9}
    # The part's slices name the same instances as the full trace's (rank 5's ops of iteration 9).
    assert part and set(part) <= set(full) and all(full[i]["args"]["iteration"] == 9 for i in part)
    starts = {e["id"] for e in events if e["ph"] == "s"}
    assert starts and starts == {e["id"] for e in events if e["ph"] == "f"}  # arrows among the ranks written


def test_a_part_names_the_asked_for_ranks_and_iterations_it_leaves_out(tmp_path, capsys):
    """--ranks 0,9 on an 8-rank run and --iterations 8-9 where only 9 was traced: the part holds rank 0's iteration 9,
    and one warning per flag says what it left out and what the trace holds."""
    write_run(tmp_path / "trace")
    assert main(["-b", str(tmp_path / "trace"), "-o", str(tmp_path / "part.json"), "--ranks", "0,9",
                 "--iterations", "8-9"]) == 0
    captured = capsys.readouterr()
    assert "Chrome trace (rank 0 of 8, iteration 9)" in captured.out
    assert captured.err.splitlines() == [
        "warning: --ranks: not in the merged trace, so left out of the Chrome trace: 9 (merged: 0-7)",
        "warning: --iterations: not traced, so left out of the Chrome trace: 8 (traced: 4-5,9-10)"]
    assert main(["-b", str(tmp_path / "trace"), "-o", str(tmp_path / "part.json"), "--ranks", "0-7"]) == 0
    assert capsys.readouterr().err == ""  # all there: nothing to say
    assert spans_text(list(range(0, 40, 2))) == "0,2,4,6,8,10,12,14 and 12 more spans"


def _bad_inputs(tmp_path):
    """Command lines -> what their one line must say."""
    write_run(tmp_path / "trace")
    (tmp_path / "empty").mkdir()
    (tmp_path / "merged_only").mkdir()  # another run's merged timeline, copied where no rank trace is
    write_chrome_trace(load_and_merge(tmp_path / "trace"), tmp_path / "merged_only" / "benchmark.json")
    return {
        ("-b", tmp_path / "nowhere"): "-b/--benchmark: ",
        ("-b", tmp_path / "empty"): "no benchmark-data-{dp}-pipeline-{pp}-tensor-{tp}.json files in",
        ("-b", tmp_path / "merged_only"): "holds no benchmark-data-{dp}-pipeline-{pp}-tensor-{tp}.json file, only "
                                          "benchmark.json, the merged timeline of run ",
        ("-b", tmp_path / "trace", "-o", tmp_path / "no" / "dir" / "out.json"): "-o/--output: cannot write",
        ("-b", tmp_path / "trace", "--sqlite", tmp_path / "trace" / "benchmark-data-0-pipeline-0-tensor-0.json"):
            "--sqlite: ",
        ("-o", tmp_path / "out.json"): "the following arguments are required: -b/--benchmark",
        ("-b", tmp_path / "trace", "--ranks", "0-3,x"): "--ranks: '0-3,x' is not a list of numbers and ranges",
        ("-b", tmp_path / "trace", "--iterations", "7-8"): "--iterations: none of them was traced",
    }


def test_bad_input_is_one_line_exit_2_and_touches_nothing(tmp_path, capsys):
    for args, expected in _bad_inputs(tmp_path).items():
        try:
            status = main([str(arg) for arg in args])
        except SystemExit as stop:  # argparse's own errors
            status = stop.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(lines) == 1 and expected in lines[0], (args, lines)
    assert len(os.listdir(tmp_path / "trace")) == 8  # nothing written, nothing overwritten


def test_command_line_tools_stop_on_bad_input_with_one_line(tmp_path):
    # A missing directory and a missing flag, as `python tools/aggregate.py` run from the repository says them.
    cases = [("tools/aggregate.py", case) for case in list(_bad_inputs(tmp_path).items())[::4]]

    def run(case):
        script, (args, _) = case
        return subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # each start-up imports torch: in parallel
        results = list(pool.map(run, cases))
    for (script, (args, expected)), result in zip(cases, results):
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], (script, args, result.stderr)


def test_a_rank_with_nothing_to_show_leaves_the_chrome_trace_valid(tmp_path):
    """A rank whose events and ops all fall outside what is shown (a --ranks/--iterations part) gets no
    tracks, and the events of the ranks around it still form one valid JSON list."""
    write_run(tmp_path / "trace")
    merged = load_and_merge(tmp_path / "trace")
    merged.ranks[1] = dataclasses.replace(merged.ranks[1], events=[])
    for instance in merged.instances:
        instance.records.pop(1, None)
    write_chrome_trace(merged, tmp_path / "merged.json")
    events = json.loads((tmp_path / "merged.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert tracks and not [name for name in tracks if "(rank 1)" in name]
    assert any("(rank 0)" in name for name in tracks) and any("(rank 2)" in name for name in tracks)


def test_compute_compares_only_the_passes_whose_tp_waits_were_recorded():
    """--trace-tp-microbatches N records the forward passes of the last N microbatches' TP collectives (the first N
    in traces written before tp_microbatches_recorded_are, their backward passes too in traces written before
    tp_backward_recorded): the compute comparison keeps those and the events outside microbatches."""
    layout = {"num_microbatches": 4}
    assert tp_waits_known({"layout": layout, "tp_microbatches_recorded": 0}) is None
    assert tp_waits_known({"layout": layout, "tp_microbatches_recorded": 1, "tp_microbatches_recorded_are": "last",
                           "tp_backward_recorded": False}) == KnownTpWaits(range(3, 4), backward=False)
    assert tp_waits_known({"layout": layout, "tp_microbatches_recorded": 1}) == KnownTpWaits(range(1), backward=True)
    # Microbatch 3's forward spans a recorded 40 us TP wait: its own compute is 60 us; microbatch 0's is unknown,
    # and so is microbatch 3's backward where only forwards were recorded.
    events = [ComputeEvent({"name": name, "microbatch": microbatch, "chunk": 0})
              for name, microbatch in (("forward", 0), ("forward", 3), ("backward", 3))]
    for event, start in zip(events, (0.0, 1000.0, 2000.0)):
        event.start, event.end = start, start + 100.0
    waits = [(1020.0, 1060.0)]
    forwards_known = operation_totals(events, waits, "training", 0, False, KnownTpWaits(range(3, 4), False))
    assert forwards_known == {("training", "forward", 0, 0): [60.0, 1, 3600.0]}
    both_known = operation_totals(events, waits, "training", 0, False, KnownTpWaits(range(3, 4), True))
    assert both_known == {("training", "forward", 0, 0): [60.0, 1, 3600.0],
                          ("training", "backward", 0, 0): [100.0, 1, 10000.0]}
