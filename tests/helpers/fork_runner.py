"""Run one script many times, each run in a process forked after the script's own imports.

    python tests/helpers/fork_runner.py SCRIPT < cases.json      (cases: [{"args": [...], "env": {...}}])

prints one JSON list: per case {"returncode", "stdout", "stderr"}. Each run is the script run as
``__main__`` with that argv and environment, as ``python SCRIPT ARGS`` runs it, but without importing
torch and megatron-core again: a start-up mistake is found in milliseconds, where a fresh interpreter
spends seconds of CPU on imports (tests/test_launch_errors.py runs two dozen of them). The script's folder is
not put first on the module search path as ``python SCRIPT`` would: the scripts run here import installed
packages only."""

import json
import os
import runpy
import sys
import tempfile
import traceback


def _child(script, args, env, out, err):
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    os.environ.update(env)
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # as the interpreter does: the traceback on stderr, exit code 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_case(script, args, env):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            _child(script, args, env, out, err)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return {"returncode": os.waitstatus_to_exitcode(status), "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}


def main():
    script = sys.argv[1]
    cases = json.load(sys.stdin)
    runpy.run_path(script, run_name="__imports_only__")  # its imports, once, before any fork
    results = [run_case(script, case["args"], case.get("env", {})) for case in cases]
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
