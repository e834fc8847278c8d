"""Each documented launch mistake stops at start with one line on stderr and a non-zero exit."""

import concurrent.futures
import signal
import subprocess
import sys

import pytest
from helpers.launch import PLUGINS, REPO, TINY_GPT, child_env, gpt_data_args, run_script, run_script_cases, torchrun

from megatron.training.errors import exit_on_user_error

MOCK = ["--mock-data", "--vocab-size", "1000", "--train-iters", "3"]

# name: (flags, environment, expected fragment of the one line)
CASES = {
    "unknown flag": (MOCK + ["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    "missing required flag": (["--num-layers", "2"], {}, "the following arguments are required"),
    "world size not divisible by TP x PP": (
        MOCK + ["--tensor-model-parallel-size", "2"], {"WORLD_SIZE": "3"},
        "world size 3 is not divisible by --tensor-model-parallel-size 2"),
    "layers not divisible by the pipeline": (
        MOCK + ["--pipeline-model-parallel-size", "3"], {"WORLD_SIZE": "3"},
        "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
    "uneven pipeline split that leaves an uneven rest": (
        MOCK + ["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "3"], {"WORLD_SIZE": "3"},
        ("--num-layers 4 minus --decoder-first-pipeline-num-layers leaves 1 layers, which do not split evenly over "
         "the other 2 pipeline stage(s)")),
    "data parallelism does not divide the global batch": (
        MOCK + ["--global-batch-size", "6"], {"WORLD_SIZE": "4"},
        "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 4"),
    "virtual pipeline without a pipeline": (
        MOCK + ["--num-layers-per-virtual-pipeline-stage", "1"], {},
        "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"),
    "bf16 and fp16 together": (MOCK + ["--bf16", "--fp16"], {}, "--bf16 and --fp16 are mutually exclusive"),
    "empty profiling window": (
        MOCK + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "3"], {},
        "--profile-step-start 3 must be >= 1 and below --profile-step-end 3"),
    "profiling window past the run": (
        MOCK + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "5"], {},
        "--profile-step-end 5 exceeds --train-iters 3"),
    "profiled rank outside the job": (
        MOCK + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "2",
                "--profile-ranks", "0", "2"], {"WORLD_SIZE": "2"},
        "--profile-ranks 2: not a rank of this job (world size 2)"),
    "nsys profiling on CPU": (
        MOCK + ["--profile", "--profile-step-start", "1", "--profile-step-end", "2"], {},
        "on CPU add --use-pytorch-profiler"),
    "fused attention on CPU": (MOCK + ["--attention-backend", "fused"], {},
                               "--attention-backend fused (cuDNN / memory-efficient kernels) needs --device cuda"),
    "flash attention with dropout on CPU": (
        MOCK + ["--attention-backend", "flash", "--attention-dropout", "0.1"], {},
        "--attention-backend flash on CPU has no attention dropout"),
    "CUDA graphs on CPU": (MOCK + ["--enable-cuda-graph"], {}, "--cuda-graph-impl local needs --device cuda"),
    "whole-iteration graph without graphs": (
        MOCK + ["--cuda-graph-scope", "full_iteration"], {},
        "--cuda-graph-scope full_iteration needs megatron-core's graphs: add --cuda-graph-impl local"),
    "two CUDA graph flags that disagree": (
        MOCK + ["--enable-cuda-graph", "--cuda-graph-impl", "none"], {},
        "--enable-cuda-graph means --cuda-graph-impl local; give only one of them"),
    "tensorboard interval of 0": (MOCK + ["--tensorboard-log-interval", "0"], {},
                                  "--tensorboard-log-interval must be >= 1"),
    "negative garbage collection interval": (MOCK + ["--manual-gc", "--manual-gc-interval", "-1"], {},
                                             "--manual-gc-interval -1 must be >= 0"),
    "garbage collection interval without --manual-gc": (MOCK + ["--manual-gc-interval", "10"], {},
                                                        "--manual-gc-interval and --no-manual-gc-eval only apply "
                                                        "with --manual-gc; add it"),
    "no data": (["--train-iters", "3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"], {},
                "give --data-path <prefix>"),
    "missing dataset files": (
        ["--train-iters", "3"] + gpt_data_args("/nonexistent/corpus_text_document"), {},
        "/nonexistent/corpus_text_document.bin does not exist"),
    "missing vocabulary file": (
        ["--train-iters", "3", "--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", "/nonexistent/vocab.json", "--merge-file", str(REPO / "datasets/gpt/merges.txt")], {},
        "/nonexistent/vocab.json"),
    "warm-up longer than the decay": (
        MOCK + ["--lr-warmup-iters", "5"], {}, "the warm-up (5 iterations) must end before the decay does"),
    "online detection without tracing": (
        MOCK + ["--trace-detect"], {}, "--trace-detect judges the trace windows: add --trace"),
    "online detection hook that cannot be imported": (
        MOCK + ["--trace", "--trace-interval", "3", "--trace-detect", "--trace-detect-hook", "no_such_module:alert"],
        {},
        "--trace-detect-hook no_such_module:alert: No module named 'no_such_module'"),
    "DPP schedule log in a missing directory": (  # issue 53: it used to fail at the end of the run, with a trace
        MOCK + ["--use-dpp", "--pipeline-model-parallel-size", "2", "--dpp-log-schedule", "/nonexistent/schedule.json"],
        {"WORLD_SIZE": "2"},
        "--dpp-log-schedule /nonexistent/schedule.json: its directory /nonexistent does not exist; create it"),
    "compiled layers with MegaScope's training hooks": (
        MOCK + ["--compile-transformer-layers", "--training-ws-port", "8765"], {},
        "--training-ws-port reads and edits activations inside the layers from hooks, which "
        "--compile-transformer-layers compiles away; drop one of them"),
    "compiled layers with attention dropout": (
        MOCK + ["--compile-transformer-layers", "--attention-dropout", "0.1"], {},
        "--compile-transformer-layers needs --attention-dropout 0 (got 0.1)"),
    "compiled layers with per-layer tracing": (
        MOCK + ["--compile-transformer-layers", "--trace", "--trace-interval", "3", "--trace-granularity", "full"], {},
        "--trace-granularity full times every layer's halves from Python, which --compile-transformer-layers"),
    "FP8 on CPU": (MOCK + ["--fp8-format", "hybrid"], {},
                   "--fp8-format hybrid --fp8-recipe tensorwise needs a GPU of compute capability 8.9 or newer (FP8 "
                   "tensor cores); --device cpu has none: drop --fp8-format"),
    "transformer engine not installed": (
        MOCK + ["--transformer-impl", "transformer_engine"], {}, "--transformer-impl transformer_engine needs"),
}


def _run(flags, env):
    return run_script("pretrain_gpt.py", TINY_GPT + flags, env=env)


@pytest.fixture(scope="module")
def results():
    # Each run would spend seconds importing megatron-core: the runs fork after one import.
    runs = run_script_cases("pretrain_gpt.py", [(TINY_GPT + flags, env) for flags, env, _ in CASES.values()])
    return dict(zip(CASES, runs))


@pytest.mark.parametrize("case", list(CASES))
def test_mistake_gives_one_clear_line(case, results):
    result, expected = results[case], CASES[case][2]
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pretrain_gpt.py: error: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize("content, shown", [(b"not-a-number", "'not-a-number'"),
                                            (b"\x00\x9f\xff\x02", "b'\\x00\\x9f\\xff\\x02'")])
def test_corrupt_checkpoint_tracker_is_named_with_the_iterations_to_load_instead(tmp_path, content, shown):
    (tmp_path / "latest_checkpointed_iteration.txt").write_bytes(content)
    for iteration in (10, 20):
        (tmp_path / f"iter_{iteration:07d}").mkdir()
    result = _run(MOCK + ["--load", str(tmp_path)], {})
    assert result.returncode == 2
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    assert result.stderr.strip().splitlines() == [
        (f"pretrain_gpt.py: error: --load: {tracker} should hold an iteration number but holds {shown}; "
         f"iterations saved there: 10, 20; write one of them into {tracker} to resume from it, or remove "
         f"--load to train from scratch")]


def test_split_without_documents_is_named(gpt_data):
    # 197 documents: a 0.1 % test share rounds to none, and megatron-core would loop forever.
    result = _run(gpt_data_args(gpt_data) + ["--train-iters", "3", "--split", "969,30,1", "--eval-iters", "1"], {})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--split 969,30,1: the test split of" in lines[0] and "gets none of its 197" in lines[0]


def _error_lines(result, prog):
    return [line for line in result.stderr.splitlines() if line.startswith(f"{prog}: error: ")]


def test_launch_error_is_printed_when_rank_0_is_stopped_before_its_check(tmp_path):
    # Rank 1 fails its check and exits while rank 0 is still before it; torchrun then stops rank 0.
    env = {"MEGATRON_PLUGINS": "late_rank_zero_plugin", "PYTHONPATH": str(PLUGINS)}
    result = torchrun(2, "pretrain_gpt.py", TINY_GPT + MOCK + ["--fail-checks-except-on-rank-0"], env=env, timeout=300)
    assert result.returncode != 0
    assert _error_lines(result, "pretrain_gpt.py") == [
        "pretrain_gpt.py: error: late_rank_zero_plugin: this rank's flags are wrong"], result.stderr


def test_launch_error_appears_in_every_launch_whole_and_alike():
    # Every rank fails at once; whichever exits first, torchrun stops the others, in each launch.
    launches, ranks = 12, 4
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: torchrun(ranks, "tests/helpers/launch_error_entry.py", [], timeout=120),
                                range(launches)))
    expected = "launch_error_entry.py: error: --trace-dir /tmp/a_file exists and is not a directory"
    for result in results:
        lines = _error_lines(result, "launch_error_entry.py")
        assert result.returncode != 0 and 1 <= len(lines) <= ranks and set(lines) == {expected}, result.stderr


@pytest.mark.parametrize("failure", ["user error", "bug"])
def test_rank_that_fails_with_a_collective_in_flight_ends_and_runs_its_exit_handlers(failure):
    """Rank 0 fails while its all-reduce waits for a peer that never joins (a stalled pipeline neighbour
    and training's stop vote): the interpreter's teardown of the group waited on it for ever (a DPP stall
    test ran into the CI's timeout), so torchrun, which acts on exits, never stopped the job."""
    args = ["bug"] if failure == "bug" else []
    result = torchrun(2, "tests/helpers/stuck_collective_entry.py", args, timeout=60)
    assert result.returncode != 0
    assert "rank 0 ran its exit handlers" in result.stdout, result.stdout + result.stderr
    if failure == "bug":
        assert "ValueError: a bug on rank 0" in result.stderr, result.stderr
    else:
        assert _error_lines(result, "stuck_collective_entry.py") == [
            "stuck_collective_entry.py: error: rank 0 gives up on its stalled peer"], result.stderr


def test_ctrl_c_before_training_is_one_line_and_exit_code_130(capsys, monkeypatch):
    """Ctrl-C during start-up (before training's agreed stop is installed) was a KeyboardInterrupt traceback per
    rank; in-process: the wrapper every entry point uses."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    monkeypatch.delenv("RANK", raising=False)  # a plain process prints its line

    @exit_on_user_error
    def interrupted_at_start_up():
        raise KeyboardInterrupt

    sigterm = signal.getsignal(signal.SIGTERM)  # the line's printer ignores SIGTERM, as a launch's rank must
    try:
        with pytest.raises(SystemExit) as stopped:
            interrupted_at_start_up()
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert stopped.value.code == 130
    assert capsys.readouterr().err == "pretrain_gpt.py: interrupted by SIGINT (Ctrl-C) before it finished\n"


def test_an_exit_caught_in_process_does_not_end_the_process_later():
    """The deadline on a rank's exit handlers is a timer: an exit that its caller catches (an entry point called
    in-process, as the test above does) must not end the caller's process when the timer fires. It did: CI's
    pytest ended with exit code 130 and no summary, 5 s after the test above. A real exit whose handler hangs
    still ends at the deadline, with its code."""
    script = (
        "import atexit, sys, threading, time\n"
        "from megatron.training import errors\n"
        "errors.EXIT_HANDLERS_SECONDS = 0.05\n"
        "@errors.exit_on_user_error\n"
        "def main():\n"
        "    raise errors.UserError('caught')\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as stopped:\n"
        "    assert stopped.code == 2\n"
        "for timer in [t for t in threading.enumerate() if isinstance(t, threading.Timer)]:\n"
        "    timer.join()\n"
        "print('still running', flush=True)\n"
        "atexit.register(time.sleep, 600)\n"
        "@errors.exit_on_user_error\n"
        "def again():\n"
        "    raise errors.UserError('not caught')\n"
        "again()\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "still running\n"
    assert result.stderr.splitlines()[-1].endswith("error: not caught"), result.stderr
