"""Traced training runs for the MegaScan tests: launch, then load their trace directories."""

import json

from helpers.launch import TINY_GPT, assert_succeeded, gpt_data_args, torchrun

LAYOUTS = {  # name: (processes, flags)
    "TP2xPP2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "DP2xTP2": (4, ["--tensor-model-parallel-size", "2"]),
    "DP2xPP2": (4, ["--pipeline-model-parallel-size", "2"]),
    "DP2xTP2xPP2": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}


def traced_run(data, trace_dir, layout, iterations=6, extra=(), check=True, **kwargs):
    processes, flags = LAYOUTS[layout]
    args = (TINY_GPT + gpt_data_args(data) + flags +
            ["--train-iters", str(iterations), "--trace", "--trace-dir", str(trace_dir),
             "--trace-interval", "3", *extra])
    result = torchrun(processes, "pretrain_gpt.py", args, **kwargs)
    if check:
        assert_succeeded(result)
    return result


def read_trace_file(path):
    return [json.loads(line) for line in path.read_text().splitlines()]
