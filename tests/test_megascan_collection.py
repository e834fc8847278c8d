"""MegaScan collection: traced multi-process runs write the documented per-rank files, tracing
does not change the losses, and bad tracing flags stop the run at start with one line."""

import concurrent.futures

import pytest
from helpers.launch import TINY_GPT, gpt_data_args, lm_losses, run_script, torchrun
from helpers.megascan_runs import read_trace_file, traced_run

MOCK = ["--mock-data", "--vocab-size", "1000", "--train-iters", "6"]


def test_tp2_pp2_virtual_pipeline_trace_files_and_unchanged_losses(gpt_data, tmp_path):
    vp = ["--num-layers-per-virtual-pipeline-stage", "1"]
    traced = traced_run(gpt_data, tmp_path / "trace", "TP2xPP2", extra=vp + ["--trace-tp-microbatches", "1"])
    plain = torchrun(4, "pretrain_gpt.py", TINY_GPT + gpt_data_args(gpt_data) + vp + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "6"])
    assert lm_losses(traced.stdout) == lm_losses(plain.stdout) and len(lm_losses(plain.stdout)) == 6

    files = sorted((tmp_path / "trace").iterdir())
    assert [f.name for f in files] == [f"benchmark-data-0-pipeline-{pp}-tensor-{tp}.json"
                                       for pp in (0, 1) for tp in (0, 1)]
    for path in files:
        metadata, *windows = read_trace_file(path)
        assert metadata["type"] == "metadata" and metadata["timer"] == "host_clock"
        assert metadata["layout"] == {**metadata["layout"], "dp": 1, "pp": 2, "tp": 2, "vp": 2}
        assert [w["iterations"] for w in windows] == [[2, 3], [5, 6]]
        for window in windows:
            assert window["complete"] and window["type"] == "window"
            # 4 microbatches x 2 chunks x 2 iterations, one layer per chunk
            names = [e["name"] for e in window["events"]]
            for name in ("forward", "backward", "attention-forward", "attention-backward",
                         "mlp-forward", "mlp-backward"):
                assert names.count(name) == 16, name
            assert names.count("iteration") == names.count("optimizer") == 2
            assert {(e["microbatch"], e["chunk"]) for e in window["events"] if e["name"] == "backward"} == {
                (m, c) for m in range(4) for c in range(2)}
            assert all(e["start_us"] <= e["end_us"] for e in window["events"])
            roles = {g["role"] for g in window["groups"].values()}
            assert {"tp", "pp"} <= roles
            kinds = {op["kind"] for op in window["ops"]}
            assert kinds == {"collective", "send", "recv"}
            assert all(op["end_us"] is not None and op["end_us"] >= op["start_us"] for op in window["ops"])
            tp_allreduces = [op for op in window["ops"] if op["op"] == "allreduce"
                             and window["groups"][op["group"]]["role"] == "tp"]
            assert tp_allreduces and all(op["bytes"] > 0 and op["dtype"] == "float32" for op in tp_allreduces)
            # --trace-tp-microbatches 1 (the GPU default): the TP collectives of the last microbatch's forward
            # passes (and loss) and those outside microbatches
            last = metadata["layout"]["num_microbatches"] - 1
            in_microbatches = {(op["microbatch"], op["phase"]) for op in tp_allreduces if op["microbatch"] is not None}
            assert last > 0 and (last, "forward") in in_microbatches <= {(last, "forward"), (last, "loss")}
            assert any(op["unrecorded_before"] > 0 for op in window["ops"])
        assert (metadata["tp_microbatches_recorded"], metadata["tp_microbatches_recorded_are"],
                metadata["tp_backward_recorded"]) == (1, "last", False)
    # The skipped ones are counted: each recorded TP collective has the same sequence number on both peers.
    for pp in (0, 1):
        peers = [read_trace_file(tmp_path / f"trace/benchmark-data-0-pipeline-{pp}-tensor-{tp}.json") for tp in (0, 1)]
        seqs = [[(w["window"], op["seq"], op["op"]) for w in windows[1:] for op in w["ops"]
                 if w["groups"][op["group"]]["role"] == "tp"] for windows in peers]
        assert seqs[0] == seqs[1] and len({seq for _, seq, _ in seqs[0]}) < max(seq for _, seq, _ in seqs[0])


def test_layer_halves_share_their_boundaries(gpt_data, tmp_path):
    """Granularity full cuts each layer into attention and MLP halves: one half ends where the
    next begins, in the forward (attention, MLP, next layer) and the backward (in reverse), and
    every half lies inside its microbatch's forward or backward."""
    traced_run(gpt_data, tmp_path, "DP2xPP2", iterations=3, extra=["--continuous-trace-iterations", "1"])
    for path in tmp_path.iterdir():  # two layers per pipeline stage, two microbatches per replica
        _, window = read_trace_file(path)
        events = {(e["iteration"], e["microbatch"], e["name"], e["layer"]): e for e in window["events"]}
        layers = sorted({layer for (_, _, _, layer) in events if layer is not None})
        assert len(layers) == 2 and len(window["events"]) == len(events)
        for microbatch in range(2):
            def half(name, layer, key, events=events, microbatch=microbatch):
                return events[(3, microbatch, name, layer)][key]
            forward, backward = (events[(3, microbatch, name, None)] for name in ("forward", "backward"))
            first, second = layers
            assert half("attention-forward", first, "end_us") == half("mlp-forward", first, "start_us")
            assert half("mlp-forward", first, "end_us") == half("attention-forward", second, "start_us")
            assert half("mlp-backward", second, "end_us") == half("attention-backward", second, "start_us")
            assert half("attention-backward", second, "end_us") == half("mlp-backward", first, "start_us")
            assert forward["start_us"] <= half("attention-forward", first, "start_us")
            assert half("mlp-forward", second, "end_us") <= forward["end_us"]
            assert backward["start_us"] <= half("mlp-backward", second, "start_us")
            assert half("attention-backward", first, "end_us") <= backward["end_us"]


def test_trace_window_at_the_end_of_training_is_kept(gpt_data, tmp_path):
    traced_run(gpt_data, tmp_path, "DP2xTP2", iterations=5, extra=["--trace-granularity", "base"])
    metadata, first, last = read_trace_file(tmp_path / "benchmark-data-1-pipeline-0-tensor-1.json")
    assert (first["iterations"], first["complete"]) == ([2, 3], True)
    assert (last["iterations"], last["complete"]) == ([5], False)
    assert not any(e["name"].startswith(("attention", "mlp")) for e in first["events"])
    # On CPU, by default, every microbatch's TP collectives are recorded, none skipped
    assert (metadata["tp_microbatches_recorded"], metadata["tp_backward_recorded"]) == (0, True)
    tp_ops = [op for op in first["ops"] if first["groups"][op["group"]]["role"] == "tp"]
    assert {op["microbatch"] for op in tp_ops} >= {0, 1}
    assert not any(op["unrecorded_before"] for op in first["ops"])


FLAG_CASES = {
    "continuous larger than the interval": (
        ["--trace-interval", "2", "--continuous-trace-iterations", "3"],
        "--continuous-trace-iterations must be between 1 and --trace-interval (2), got 3"),
    "interval past the last iteration": (
        ["--trace-interval", "7"], "--trace-interval 7 is larger than --train-iters 6"),
    "interval zero": (["--trace-interval", "0"], "--trace-interval must be at least 1, got 0"),
    "unknown granularity": (["--trace-granularity", "fine"], "argument --trace-granularity: invalid choice"),
    "negative TP microbatches": (["--trace-tp-microbatches", "-1"],
                                 "--trace-tp-microbatches must be 0 (record all) or more, got -1"),
}


@pytest.mark.parametrize("name", FLAG_CASES)
def test_bad_trace_flags_are_one_line(name, tmp_path):
    flags, expected = FLAG_CASES[name]
    result = run_script("pretrain_gpt.py", TINY_GPT + MOCK + ["--trace", "--trace-dir", tmp_path, *flags])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_trace_dir_with_another_runs_files_is_refused_and_left_alone(tmp_path):
    existing = tmp_path / "benchmark-data-0-pipeline-0-tensor-0.json"
    existing.write_text("{}\n")
    cases = [
        (["--trace", "--trace-dir", tmp_path], "already holds traces of another run"),
        (["--trace", "--trace-dir", existing], "exists and is not a directory"),
        (["--inject-slowdown-rank", "3"], "--inject-slowdown-rank 3 is not a rank of this job (0..0)"),
        (["--inject-hang-rank", "0"], "--inject-hang-rank needs --inject-hang-iteration"),
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: run_script("pretrain_gpt.py", TINY_GPT + MOCK + case[0]), cases))
    for (_, expected), result in zip(cases, results):
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], result.stderr
    assert existing.read_text() == "{}\n"

