"""The GPU detection matrix's command (bench/gpu_megascan_detection.sh, MATRIX=1) and its table
(bench/detection_matrix.py), on CPU: the tiny job at DP2, traced and judged online and offline for real. Its
healthy case passes; its loaded case runs to the end though the GPU load cannot start here, and fails saying so.
The case lists the matrix makes for 2 and 4 GPUs, and bad settings refused in one line."""

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.launch import REPO, child_env, run_script

from megatron.training.ports import free_port

ROW = re.compile(r"^\| (.*) \|$")


def run_bench(results, **env):
    """The script as a user runs it, this interpreter's python3 and torchrun first on PATH."""
    environment = child_env({"RESULTS": str(results), "MASTER_PORT": str(free_port()), **env,
                             "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    return subprocess.run(["bash", str(REPO / "bench/gpu_megascan_detection.sh")], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=300)


def table_rows(output):
    """case name -> the cells of its row in the printed markdown table."""
    rows = [match.group(1).split(" | ") for match in map(ROW.match, output.splitlines()) if match]
    return {cells[0]: cells for cells in rows[1:]}  # after the header (the rule below it has no cells)


def healthy_median(log):
    """The log's per-iteration times after the two warm-up iterations, their median, as the table writes it."""
    times = [float(ms) for iteration, ms in re.findall(
        r"iteration +(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)", log) if int(iteration) > 2]
    return f"{statistics.median(times):.1f}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="where there is a GPU, the load would start on it")
def test_a_cpu_part_of_the_matrix_is_run_and_tabulated(tmp_path):
    result = run_bench(tmp_path, MATRIX="1", GPUS="2", SIZES_LIST="tiny", ONLY="dp2", DUTIES="0.5",
                       HEALTHY_RUNS="1", DEVICE="cpu", ITERS="10")
    assert result.returncode == 0, result.stderr[-3000:]
    healthy, loaded = tmp_path / "detect_tiny-dp2-healthy-1", tmp_path / "detect_tiny-dp2-gpu1-d0.5"
    assert json.loads((healthy / "case.json").read_text()) == {
        "name": "tiny-dp2-healthy-1", "model": "tiny", "layout": "dp2", "gpu": None, "loaded_rank": None,
        "duty": None, "onset": 8, "iterations": 10, "exit": 0}
    assert json.loads((loaded / "case.json").read_text()) == {
        "name": "tiny-dp2-gpu1-d0.5", "model": "tiny", "layout": "dp2", "gpu": 1, "loaded_rank": 1,
        "duty": 0.5, "onset": 8, "iterations": 10, "exit": 0}
    # the load was started at the onset and refused to run without a GPU; the script went on
    assert (loaded / "load.log").read_text() == "gpu_load.py: error: no CUDA device: gpu_load.py needs a GPU\n"
    assert [window["iterations"] for window in json.loads((healthy / "report.json").read_text())["windows"]] == [
        [4, 5], [9, 10]]

    summary = run_script("bench/detection_matrix.py", [tmp_path])
    assert summary.returncode == 0, summary.stderr
    rows = table_rows(summary.stdout)
    reference = f"{healthy_median((healthy / 'log').read_text())} (1 healthy run)"
    assert rows["tiny-dp2-healthy-1"] == [
        "tiny-dp2-healthy-1", "tiny DP2", "healthy", reference, "", "none", "none", "no suspect", "yes", "", "PASS"]
    row = rows["tiny-dp2-gpu1-d0.5"]
    assert row[2:4] == ["GPU 1: rank 1 (DP replica), duty 0.5, from iteration 8 (configured)", reference]
    assert row[5:9] == ["none", "none", "no suspect", "yes"]
    assert row[10].startswith("FAIL: the load never began (no marker in the log); offline: window(s) 1 do not "
                              "name rank 1 first; online: window(s) 1 do not name rank 1 first; ")
    assert summary.stdout.endswith("\n1 of 2 case(s) pass\n")


def test_the_matrix_on_two_gpus_is_each_layouts_loads_between_its_healthy_runs(tmp_path):
    result = run_bench(tmp_path, MATRIX="1", GPUS="2", SIZES_LIST="1.3b_mb8", LIST="1")
    assert result.returncode == 0, result.stderr
    jobs = {"tp2": ["gpu1"], "pp2": ["gpu0", "gpu1"], "dp2": ["gpu1"]}
    expected = []
    for layout, gpus in jobs.items():
        loads = [f"1.3b_mb8-{layout}-{gpu}-d{duty}:1.3b_mb8:{layout}:{gpu[3:]}:{duty}:8"
                 for gpu in gpus for duty in ("0.3", "0.5")]
        expected += [f"1.3b_mb8-{layout}-healthy-1:1.3b_mb8:{layout}:none::8", *loads,
                     f"1.3b_mb8-{layout}-healthy-2:1.3b_mb8:{layout}:none::8"]
    assert result.stdout.splitlines() == expected + ["14 case(s) of 30 iterations"]
    assert list(tmp_path.iterdir()) == []  # a listing runs nothing, nor preprocesses the data


def test_the_matrix_on_four_gpus_loads_a_tp_peer_both_stages_a_replica_and_pp4s_ends(tmp_path):
    result = run_bench(tmp_path, MATRIX="1", GPUS="4", DUTIES="0.5", HEALTHY_RUNS="2", LIST="1")
    assert result.returncode == 0, result.stderr
    cases = [line.split(":") for line in result.stdout.splitlines()[:-1]]
    assert sorted((size, layout, gpu) for _, size, layout, gpu, _, _ in cases if gpu != "none") == sorted(
        (size, layout, gpu) for size in ("1.3b_mb8", "345m") for layout, gpu in (
            ("tp2dp2", "1"), ("dp2pp2", "0"), ("dp2pp2", "3"), ("dp4", "2"), ("pp4", "0"), ("pp4", "3")))
    healthy = [name for name, _, _, gpu, _, _ in cases if gpu == "none"]
    assert len(healthy) == 2 * 2 * 4  # each of the 4 jobs twice, at both sizes
    assert result.stdout.splitlines()[-1] == "28 case(s) of 30 iterations"


@pytest.mark.parametrize("env, line", [
    ({"GPUS": "2", "ONLY": "pp4"}, "ONLY: no layout 'pp4' in the 2-GPU matrix; its layouts are tp2 pp2 dp2"),
    ({"GPUS": "8"}, "MATRIX=1: the matrix is for 2 or 4 GPUs and GPUS is 8 (nvidia-smi's count unless set); set "
                    "GPUS=2 or GPUS=4 (the first GPUS GPUs are used)"),
    ({"GPUS": "2", "SIZES_LIST": "7b"}, "SIZES_LIST: no size '7b'; the sizes are tiny 1.3b 1.3b_mb8 345m"),
    ({"GPUS": "2", "DUTIES": "1.5"}, "case 1.3b_mb8-tp2-gpu1-d1.5: duty '1.5' is not a number in (0, 1]"),
    ({"CASES": "a:tiny:dp2:none"}, "MATRIX=1 makes its own cases: leave CASES unset (ONLY, SIZES_LIST, DUTIES and "
                                   "HEALTHY_RUNS choose among them)"),
    # the cases given by hand are checked the same way
    ({"MATRIX": "0", "CASES": "a:tiny:dp2:none b:tiny"}, "case b: no layout ''; the layouts are 1 dp2 dp2pp2 dp4 "
                                                         "pp2 pp4 tp2 tp2dp2 tp2pp2"),
])
def test_a_bad_setting_is_refused_in_one_line_before_anything_runs(tmp_path, env, line):
    result = run_bench(tmp_path, **{"MATRIX": "1", **env})
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"gpu_megascan_detection.sh: {line}\n")
    assert list(tmp_path.iterdir()) == []  # not even the data preprocessed


def test_the_table_of_a_folder_without_cases_is_refused_in_one_line(tmp_path):
    for folder, line in ((tmp_path / "missing", f"{tmp_path / 'missing'} is not a directory; pass the RESULTS that "
                                                f"bench/gpu_megascan_detection.sh wrote into"),
                         (tmp_path, f"no case under {tmp_path} (a folder with case.json); run MATRIX=1 "
                                    f"RESULTS={tmp_path} bash bench/gpu_megascan_detection.sh first")):
        result = run_script("bench/detection_matrix.py", [folder])
        assert (result.returncode, result.stdout, result.stderr) == (2, "", f"detection_matrix.py: error: {line}\n")
