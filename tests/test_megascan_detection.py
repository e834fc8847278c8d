"""MegaScan end to end on CPU: traced runs with one rank slowed (or stopped, or its host delayed) by the
fault-injection flags, aggregated and analysed: the report names exactly that rank first, and nobody in a
healthy run; with --trace-detect the same verdict comes as an alert during the run, which can stop it."""

import json
import subprocess
import sys
import time

import pytest
from helpers.launch import (
    PLUGINS,
    REPO,
    TINY_GPT,
    child_env,
    gpt_data_args,
    kill_process_tree,
    running_with_argument,
    torchrun_command,
)
from helpers.megascan_runs import LAYOUTS, read_trace_file, traced_run

from megascan.aggregate import load_and_merge
from megascan.detection import detect
from megascan.online_detection import ALERT_PREFIX

SLOW = {  # name: (layout, slowed rank, flags): a TP peer, a DP replica, a pipeline stage
    "tp peer": ("TP2xPP2", 1, []),
    # as on GPUs: only the last microbatch's forward records its TP collectives, the rest are counted
    "tp peer, last forward recorded": ("TP2xPP2", 1, ["--trace-tp-microbatches", "1"]),
    "dp replica": ("DP2xTP2", 2, []),
    "pp stage": ("DP2xPP2", 3, []),
}


def _alerts(output):
    return [line for line in output.splitlines() if line.startswith(ALERT_PREFIX)]


@pytest.mark.parametrize("name", SLOW)
def test_slowed_rank_is_named_first_and_alone(gpt_data, tmp_path, name):
    """Offline, and online: the alert of the first trace window (iterations 2-3) already names it."""
    layout, rank, flags = SLOW[name]
    result = traced_run(gpt_data, tmp_path, layout, extra=["--inject-slowdown-rank", str(rank),
                                                           "--inject-slowdown-factor", "8", "--trace-detect", *flags])
    report = detect(load_and_merge(tmp_path))
    assert [s.rank for s in report.suspects] == [rank], report.to_text()
    assert report.suspects[0].kind == "slow_rank"
    alerts = _alerts(result.stdout)
    assert alerts and alerts[0].startswith(f"{ALERT_PREFIX} window 0 (iterations 2-3): rank {rank} ("), alerts


def test_detection_exit_stops_the_job_after_the_alerting_window(gpt_data, tmp_path):
    """--trace-detect-exit: every rank stops after the window that raised the alert (iteration 3 of 9), exit
    code 0, the checkpoint saved; the hook got the alert on rank 0."""
    alerts_file = tmp_path / "alerts.jsonl"
    result = traced_run(gpt_data, tmp_path / "trace", "TP2xPP2", iterations=9, check=False,
                        extra=["--inject-slowdown-rank", "1", "--inject-slowdown-factor", "8", "--trace-detect",
                               "--trace-detect-exit", "--trace-detect-hook", "alert_hook:record",
                               "--save", str(tmp_path / "ckpt"), "--save-interval", "100"],
                        env={"PYTHONPATH": str(PLUGINS), "MEGASCAN_ALERT_FILE": str(alerts_file)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "MegaScan: stopping training after iteration 3 (--trace-detect-exit)" in result.stdout
    assert (tmp_path / "ckpt/latest_checkpointed_iteration.txt").read_text().strip() == "3"
    hooked = [json.loads(line) for line in alerts_file.read_text().splitlines()]
    assert [(alert["window"], alert["suspects"][0]) for alert in hooked] == [(0, 1)]
    assert hooked[0]["line"] in result.stdout
    windows = [line["window"] for line in read_trace_file(tmp_path / "trace/benchmark-data-0-pipeline-0-tensor-1.json")
               if line["type"] == "window"]
    assert windows == [0]


def test_host_delayed_rank_is_host_bound_not_a_slow_rank(gpt_data, tmp_path):
    """Rank 1's host sleeps before each microbatch (as slow data loading would): its layers are as fast as
    its peers', so it is no slow rank; on CPU host and device share one clock, so what shows is own work
    outside the traced layers: host-bound. 150 ms makes that own work about 5x its peers', clear of the
    3x that processes sharing two cores reach by themselves (60 ms measured 2.7-2.95x: named in some runs)."""
    traced_run(gpt_data, tmp_path, "TP2xPP2", extra=["--inject-host-delay-rank", "1",
                                                      "--inject-host-delay-ms", "150"])
    report = detect(load_and_merge(tmp_path))
    assert report.suspects == [], report.to_text()
    assert [entry.rank for entry in report.host_bound] == [1], report.to_text()
    assert "outside the model's layers" in report.host_bound[0].evidence[0]
    assert "Host-bound (not a slow GPU" in report.to_text()


def test_healthy_run_names_nobody_and_aggregates_completely(gpt_data, tmp_path):
    result = traced_run(gpt_data, tmp_path / "trace", "DP2xTP2xPP2", extra=["--trace-detect"])
    assert _alerts(result.stdout) == []
    merged = load_and_merge(tmp_path / "trace")
    assert len(merged.ranks) == 8 and not merged.unaligned
    assert all(not i.missing and len(i.records) == len(i.participants) for i in merged.instances)
    assert {i.kind for i in merged.instances} == {"collective", "p2p"}
    assert detect(merged).suspects == []
    result = subprocess.run([sys.executable, str(REPO / "tools/aggregate.py"), "-b", str(tmp_path / "trace"),
                             "-o", str(tmp_path / "merged.json"), "-d"], capture_output=True, text=True, cwd=REPO,
                            check=False)
    assert result.returncode == 0 and "no suspect" in result.stdout, result.stdout + result.stderr
    chrome = json.loads((tmp_path / "merged.json").read_text())
    events = chrome["traceEvents"] if isinstance(chrome, dict) else chrome
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert {"DP1-PP1-TP1"} <= {n.split(" ")[0] for n in names}
    starts = {e["id"] for e in events if e.get("ph") == "s"}
    assert starts and starts == {e["id"] for e in events if e.get("ph") == "f"}


# In the first trace window (nothing to align on), with every TP collective recorded; in the second, in a
# microbatch whose TP collectives are only counted (GPUs' default), where rank 0 blocks in one that only its
# issued line names.
@pytest.mark.parametrize("iteration, tp_microbatches", [(3, "0"), (6, "1")])
def test_stopped_rank_is_reported_as_hung(gpt_data, tmp_path, iteration, tp_microbatches):
    """Rank 1 freezes inside a trace window; its peers block, their writers report what they issued
    and write PyTorch's flight recorder (on through TORCH_FR_BUFFER_SIZE), the job is killed, and the
    partial traces name rank 1; so does the flight recorder, a second witness: rank 1 left no dump (gloo
    records no completion, so that is all its dumps can tell; NCCL's: test_megascan_flight_recorder.py)."""
    processes, flags = LAYOUTS["TP2xPP2"]
    trace = tmp_path / "trace"
    args = (TINY_GPT + gpt_data_args(gpt_data) + flags +
            ["--train-iters", "6", "--trace", "--trace-dir", str(trace), "--trace-interval", "3",
             "--trace-tp-microbatches", tp_microbatches,
             "--inject-hang-rank", "1", "--inject-hang-iteration", str(iteration)])
    job = subprocess.Popen(torchrun_command(processes, "pretrain_gpt.py", args), cwd=REPO,
                           env=child_env({"TORCH_FR_BUFFER_SIZE": "256"}),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # the three blocked peers write "issued" lines and dumps once stalled
            reported = [f for f in trace.glob("benchmark-data-*.json") if '"type":"issued"' in f.read_text()]
            if len(reported) == 3 and len(list(trace.glob("flight-recorder-*.pkl"))) == 3:
                break
            time.sleep(1)
    finally:
        kill_process_tree(job.pid)
        job.wait()
    survivors = running_with_argument(str(trace))  # every rank has the directory in its flags
    assert survivors == [], f"processes of the killed job still running: {survivors}"
    if tp_microbatches == "1":  # rank 1's TP peer blocks in a counted collective of the first microbatch
        issued = [json.loads(line) for line in (trace / "benchmark-data-0-pipeline-0-tensor-0.json").open()
                  if '"type":"issued"' in line]
        assert [(op["microbatch"], op["iteration"]) for op in issued[-1]["ops"] if op.get("unrecorded")] == [
            (0, iteration)], issued
    report = detect(load_and_merge(trace))
    assert [(s.rank, s.kind) for s in report.suspects] == [(1, "hang")], report.to_text()
    assert "never reached" in report.suspects[0].evidence[0]
    assert sorted(p.name for p in trace.glob("flight-recorder-*.pkl")) == [
        f"flight-recorder-{rank}.pkl" for rank in (0, 2, 3)]
    result = subprocess.run([sys.executable, str(REPO / "tools/aggregate.py"), "-b", str(trace), "-d",
                             "--report-json", str(tmp_path / "report.json")],
                            capture_output=True, text=True, cwd=REPO, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    second = json.loads((tmp_path / "report.json").read_text())["flight_recorder"]
    assert second["without_dump"] == [1] and second["hung"] == [1], result.stdout
    assert sorted(second["last"]) == ["0", "2", "3"] and not second["records_completion"], result.stdout
    assert "agrees with the traces (hung there: [1])" in result.stdout, result.stdout
    (tmp_path / "crafted_0").write_bytes(b"cos\nsystem\n(S'echo ran'\ntR.")  # a pickle that would run a command
    result = subprocess.run([sys.executable, str(REPO / "tools/aggregate.py"), "-b", str(trace),
                             "--flight-recorder", str(tmp_path / "crafted_")],
                            capture_output=True, text=True, cwd=REPO, check=False)
    assert result.returncode == 2 and "ran" not in result.stdout, result.stdout + result.stderr
    error = result.stderr.splitlines()[-1]  # after the merge's warnings, if any
    assert "Traceback" not in result.stderr and error.startswith("tools/aggregate.py: --flight-recorder:"), error
    assert "not a PyTorch flight-recorder dump" in error, result.stderr
