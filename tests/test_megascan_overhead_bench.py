"""bench/megascan_overhead.py on CPU (two gloo ranks at TP2), and bench/megascan_overhead_pool.py over its
--bench-json: the figures it pools are the ones the benchmark printed, and a run of another job is refused."""

import json

import pytest
from helpers.launch import TINY_GPT, assert_succeeded, gpt_data_args, run_script, torchrun


def test_runs_pool_into_the_benchmarks_own_figures_and_other_jobs_are_refused(gpt_data, tmp_path):
    figures = tmp_path / "run.json"
    assert_succeeded(torchrun(2, "bench/megascan_overhead.py", TINY_GPT + gpt_data_args(gpt_data) + [
        "--tensor-model-parallel-size", "2", "--train-iters", "1000", "--trace", "--trace-dir", tmp_path / "trace",
        "--trace-interval", "5", "--continuous-trace-iterations", "2", "--bench-rounds", "3",
        "--bench-modes", "off,base", "--trace-granularity", "base", "--bench-json", figures], timeout=300))
    run = json.loads(figures.read_text())
    assert run["model"] == "4 layers, hidden 64, sequence 64, micro batch 2, global batch 8"

    pooled = run_script("bench/megascan_overhead_pool.py", [figures, figures])
    assert pooled.returncode == 0, pooled.stderr
    lines = pooled.stdout.splitlines()
    own = run["base"]["traced_iterations"]["median_percent"]
    # the run alone, then both runs' 6 rounds: the same rounds twice have the same median
    assert [line for line in lines if line.startswith("  base traced:")] == [
        line for line in lines if line.startswith(f"  base traced: {own:+.2f} % (")]
    assert len([line for line in lines if line.startswith("  base traced:")]) == 3
    assert "pooled: 6 rounds of 2 runs" in pooled.stdout
    assert [line.split(":")[0] for line in lines[1:6]] == [
        "  base traced", "  base untraced", "  base interval", "  base position 4", "  base position 5"]

    other = tmp_path / "other.json"
    other.write_text(json.dumps({**run, "layout": "TP1xPP1xDP2"}))
    refused = run_script("bench/megascan_overhead_pool.py", [figures, other])
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"megascan_overhead_pool.py: error: {other}: another job (layout TP1xPP1xDP2, interval 5, continuous 2, "
        f"model {run['model']}, cuda_graphs none) than {figures} (layout TP2xPP1xDP1, interval 5, continuous 2, "
        f"model {run['model']}, cuda_graphs none): pool runs of one job only"]


@pytest.mark.parametrize("flags, line", [
    # a job traced at base has no layer tracers: its 'full' intervals would time base tracing under another name
    (["--train-iters", "1000", "--trace-granularity", "base"],
     "--bench-modes off,base,full times 'full', which needs --trace-granularity full (its default); or give "
     "--bench-modes off,base"),
    # the data loader would run dry part-way (a StopIteration from deep inside, as seen on a GPU)
    (["--train-iters", "100", "--bench-rounds", "10"],
     "--bench-rounds 10 runs 165 iterations (3 modes, --trace-interval 5, a warm-up interval each), more than the "
     "--train-iters 100 the data is drawn for; raise --train-iters to 165"),
])
def test_a_job_the_benchmark_cannot_time_is_refused_in_one_line(gpt_data, tmp_path, flags, line):
    result = run_script("bench/megascan_overhead.py", TINY_GPT + gpt_data_args(gpt_data) + [
        "--trace", "--trace-dir", tmp_path / "trace", "--trace-interval", "5", *flags])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "setup done" not in result.stdout  # refused before the model and data are built
    # (megatron-core's import warnings come before it)
    assert [text for text in result.stderr.splitlines() if "error" in text] == [f"megascan_overhead.py: error: {line}"]
