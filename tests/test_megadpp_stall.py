"""A DPP job whose pipeline neighbour stalls ends, within --dpp-timeout, with one line that names the stalled
rank and the transfer its neighbour waited for (instead of waiting for ever on a message that never comes).

The stall is a SIGSTOP of the last stage while it sleeps inside the schedule (a slowed forward of
--dpp-delay-stage, or DPP's own wait for an input): stopped there, its neighbour is left waiting on DPP's
transfers. (Stopped inside the optimizer's collectives instead, the job would end at torch.distributed's own
timeout, which is not DPP's to report.)"""

import signal
import subprocess
import time
from pathlib import Path

from helpers.launch import (
    REPO,
    TINY_GPT,
    child_env,
    gpt_data_args,
    kill_process_tree,
    torchrun_command,
    worker_of_rank,
)

TIMEOUT_S = 3


def _stop_while_sleeping(process, within_s=60):
    """SIGSTOP ``process`` at a moment its main thread sleeps (time.sleep: the kernel's nanosleep)."""
    wchan = Path(f"/proc/{process.pid}/wchan")
    deadline = time.monotonic() + within_s
    while "nanosleep" not in wchan.read_text():
        assert time.monotonic() < deadline, "the stage never slept"
        time.sleep(0.001)  # it sleeps 200 ms a forward: a millisecond's look is soon enough
    process.send_signal(signal.SIGSTOP)


def test_stalled_neighbour_ends_the_job_naming_it(gpt_data):
    command = torchrun_command(2, "pretrain_gpt.py", TINY_GPT + gpt_data_args(gpt_data) + [
        "--pipeline-model-parallel-size", "2", "--use-dpp", "--dpp-timeout", TIMEOUT_S, "--train-iters", "100000",
        "--dpp-delay-stage", "1", "--dpp-delay-ms", "200"])
    job = subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    output = []
    try:
        for line in job.stdout:  # the last stage logs each iteration: the pipeline runs
            output.append(line)
            if " iteration        3/" in line:
                break
        _stop_while_sleeping(worker_of_rank(job.pid, 1))
        stopped_at = time.monotonic()
        output.append(job.communicate(timeout=120)[0])
        ended_after = time.monotonic() - stopped_at
    finally:
        if job.returncode is None:
            kill_process_tree(job.pid)
            job.wait()
    text = "".join(output)
    assert job.returncode != 0, text[-3000:]
    lines = [line for line in text.splitlines() if "pretrain_gpt.py: error: MegaDPP: rank 0" in line]
    assert lines, text[-3000:]
    assert f"waited {TIMEOUT_S} s for the output gradient of microbatch" in lines[0], lines[0]
    print(lines[0])
    assert "from rank 1" in lines[0] and "stalled or dead" in lines[0], lines[0]
    assert "megadpp/runtime.py" not in text, text[-3000:]  # no traceback from the worker (torchrun prints its own)
    assert ended_after < TIMEOUT_S + 60, ended_after  # torchrun then stops the stopped rank
