"""--trace composes with --use-dpp: the shared-memory transport's transfers (they bypass torch.distributed)
are recorded as MegaScan point-to-point ops (peer, bytes, sequence, microbatch, chunk), tools/aggregate.py
matches every one of them and draws their flows, and detection names first the pipeline stage that
--inject-slowdown-rank slowed."""

import collections
import json
import subprocess
import sys

from helpers.launch import REPO, TINY_GPT, assert_succeeded, gpt_data_args, torchrun
from helpers.megascan_runs import read_trace_file

from megascan.aggregate import load_and_merge
from megascan.detection import detect


def test_traced_dpp_run_matches_transfers_and_names_the_slowed_stage(gpt_data, tmp_path):
    trace_dir = tmp_path / "trace"
    result = torchrun(2, "pretrain_gpt.py", TINY_GPT + gpt_data_args(gpt_data) + [
        "--pipeline-model-parallel-size", "2", "--use-dpp", "--train-iters", "6", "--trace",
        "--trace-dir", trace_dir, "--trace-interval", "3", "--inject-slowdown-rank", "1",
        "--inject-slowdown-factor", "8"], timeout=600)
    assert_succeeded(result)
    assert ("MegaDPP: depth-first dynamic pipeline schedule over shared memory within a node; "
            "--trace records its transfers") in result.stdout

    for pp_rank, phases in ((0, {"forward-send", "backward-recv"}), (1, {"forward-recv", "backward-send"})):
        windows = [line for line in read_trace_file(trace_dir / f"benchmark-data-0-pipeline-{pp_rank}-tensor-0.json")
                   if line["type"] == "window"]
        transfers = [op for window in windows for op in window["ops"] if op["kind"] in ("send", "recv")]
        assert {op["phase"] for op in transfers} == phases
        assert all(op["peer"] == 1 - pp_rank and op["bytes"] > 0 and op["chunk"] == 0 for op in transfers)
        for phase in phases:  # every microbatch of each traced iteration, numbered by the transport's channel
            ops = [op for op in transfers if op["phase"] == phase]
            per_microbatch = collections.Counter(op["microbatch"] for op in ops)
            assert set(per_microbatch) == {0, 1, 2, 3} and len(set(per_microbatch.values())) == 1, per_microbatch
            assert len({op["seq"] for op in ops}) == len(ops)

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
