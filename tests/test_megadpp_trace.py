"""--trace composes with --use-dpp: the DPP transport's transfers are recorded as MegaScan point-to-point
ops (peer, bytes, sequence, microbatch, chunk), tools/aggregate.py matches every one of them and draws
their flows, and detection names first the pipeline stage that --inject-slowdown-rank slowed."""

import json
import subprocess
import sys

from launch import REPO, TINY_GPT, assert_succeeded, gpt_data_args, torchrun
from megascan.aggregate import load_and_merge
from megascan.detection import detect
from megascan_runs import read_trace_file


def test_traced_dpp_run_matches_transfers_and_names_the_slowed_stage(gpt_data, tmp_path):
    trace_dir = tmp_path / "trace"
    result = torchrun(2, "pretrain_gpt.py", TINY_GPT + gpt_data_args(gpt_data) + [
        "--pipeline-model-parallel-size", "2", "--use-dpp", "--train-iters", "6", "--trace",
        "--trace-dir", trace_dir, "--trace-interval", "3", "--inject-slowdown-rank", "1",
        "--inject-slowdown-factor", "8"], timeout=600)
    assert_succeeded(result)
    assert "MegaDPP: depth-first dynamic pipeline schedule over torch.distributed" in result.stdout

    windows = [line for line in read_trace_file(trace_dir / "benchmark-data-0-pipeline-0-tensor-0.json")
               if line["type"] == "window"]
    sends = [op for window in windows for op in window["ops"] if op["kind"] == "send"]
    assert sends and all(op["peer"] == 1 and op["bytes"] > 0 and op["seq"] >= 0 for op in sends)
    assert {op["microbatch"] for op in sends if op["phase"] != "iteration"} >= {0, 1, 2, 3}
    assert all(op["chunk"] == 0 for op in sends if op["microbatch"] is not None)

    merged = load_and_merge(trace_dir)
    p2p = [i for i in merged.instances if i.kind == "p2p"]
    assert p2p and all(not i.missing and len(i.records) == 2 for i in p2p)
    report = detect(merged)
    assert report.suspects and report.suspects[0].rank == 1, report.to_text()  # first: the CPU is shared

    chrome_path = tmp_path / "merged.json"
    subprocess.run([sys.executable, str(REPO / "tools/aggregate.py"), "-b", str(trace_dir), "-o", str(chrome_path)],
                   check=True, capture_output=True, cwd=REPO)
    chrome = json.loads(chrome_path.read_text())
    events = chrome["traceEvents"] if isinstance(chrome, dict) else chrome
    flows = [e for e in events if e.get("ph") == "s" and e.get("cat") == "flow.p2p"]
    assert len(flows) >= len(p2p)
