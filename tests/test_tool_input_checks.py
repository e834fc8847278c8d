"""Issue 53: the checkpoint tools check their inputs and outputs before loading anything, and refuse them in one
line (the real commands, each case forked after the imports: tests/helpers/fork_runner.py)."""

from helpers.generation_server import TINY_SERVER
from helpers.launch import run_script_cases

GREEDY = "tools/checkpoint/generate_greedy.py"


def test_generate_greedy_refuses_its_prompts_and_output_before_loading(tmp_path):
    """These used to end in a trace after the checkpoint had loaded (the output's after generating). ``--load`` is
    an empty directory, refused when loading starts: each case must be refused before it."""
    load = tmp_path / "checkpoints"
    load.mkdir()
    good, bad = tmp_path / "prompts.json", tmp_path / "bad.json"
    good.write_text('["The cat sat"]')
    bad.write_text('["The cat sat",\n "A dog ran"')
    missing_dir = tmp_path / "results" / "out.pt"
    cases = {
        (tmp_path / "nowhere.json", tmp_path / "out.pt"):
            f"--prompts-json {tmp_path / 'nowhere.json'}: no such file; give a JSON list of strings",
        (bad, tmp_path / "out.pt"):
            f"--prompts-json {bad}:2: not valid JSON (Expecting ',' delimiter); give a JSON list of strings",
        (good, missing_dir): (f"--output {missing_dir}: its directory {missing_dir.parent} does not exist; "
                              f"create it or give a path in an existing directory"),
    }
    results = run_script_cases(GREEDY, [(TINY_SERVER + ["--load", load, "--prompts-json", prompts, "--output", output],
                                         None) for prompts, output in cases])
    for result, expected in zip(results, cases.values()):
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith(f"generate_greedy.py: error: {expected}"), lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "checkpoints", "prompts.json"]
