"""MegaScope's page (tools/visualization/transformer-visualize): its vitest unit tests, its production build,
and its end-to-end scenarios in Debian's Chromium (playwright-core) against the real backend: the text
generation server on a tiny model (inference) and on a Llama-3-8B-shaped one (the page at scale), and a training
run with --training-ws-port (training).

Node.js and npm are needed (skipped with the reason when absent); Chromium is installed by apt when missing
and this runs as root (CI), else $CHROMIUM names it. Screenshots go to the page's e2e-artifacts/, or to
$MEGASCOPE_SCREENSHOTS (MEGASCOPE_SCREENSHOTS=docs/images refreshes the README's)."""

import os
import re
import shutil
import subprocess
import threading

import pytest
from helpers.generation_server import TINY_SERVER, GenerationServer
from helpers.launch import REPO, TINY_GPT, child_env, kill_process_tree, torchrun_command

from megatron.training.ports import free_port

PAGE = REPO / "tools" / "visualization" / "transformer-visualize"
NPM = shutil.which("npm")
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(not (NPM and NODE),
                                reason="Node.js and npm are not installed: the page's tests need them "
                                       "(Node 20 and npm; e.g. apt-get install nodejs npm)")


def run_in_page(*command, env=None, timeout=600):
    """Run a command in the page's folder; its output is in the assertion message when it fails."""
    env = dict(env or {})
    if os.environ.get("MEGASCOPE_SCREENSHOTS"):  # a folder named from where pytest runs, not from the page's
        env["MEGASCOPE_SCREENSHOTS"] = os.path.abspath(os.environ["MEGASCOPE_SCREENSHOTS"])
    done = subprocess.run(command, cwd=PAGE, env=child_env(env), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, \
        f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def node_modules():
    """`npm ci` when node_modules is missing or older than the lockfile (npm writes its own copy of the lock there)."""
    installed = PAGE / "node_modules" / ".package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < (PAGE / "package-lock.json").stat().st_mtime:
        run_in_page(NPM, "ci", "--no-audit", "--no-fund")


@pytest.fixture(scope="module")
def built(node_modules):
    run_in_page(NPM, "run", "build")
    return PAGE / "dist"


@pytest.fixture(scope="module")
def chromium():
    path = os.environ.get("CHROMIUM") or shutil.which("chromium")
    if not path and os.geteuid() == 0 and shutil.which("apt-get"):
        for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            subprocess.run(command, check=True, capture_output=True,
                           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        path = shutil.which("chromium")
    assert path, "Chromium is missing: apt-get install -y chromium (as root), or set CHROMIUM to its executable"
    return path


def test_unit_tests(node_modules):
    output = run_in_page(NPM, "run", "test")
    assert " passed" in output and "failed" not in output, output


def test_build_uses_relative_asset_paths(built):
    index = (built / "index.html").read_text()
    assert 'src="./assets/' in index and 'href="./assets/' in index, index
    assert list((built / "assets").glob("*.js")), "the build wrote no script"


def page_against_a_server(script, server_flags, chromium):
    """The output of e2e ``script`` run in the browser against a generation server started with ``server_flags``."""
    server = GenerationServer(1, server_flags)
    try:
        return run_in_page(NODE, script, env={"MEGASCOPE_HTTP": server.rest, "MEGASCOPE_WS": server.ws,
                                              "CHROMIUM": chromium})
    finally:
        server.stop()


def test_inference_in_a_real_browser(built, chromium):
    output = page_against_a_server("e2e/inference.mjs", TINY_SERVER, chromium)
    assert "tokens match REST" in output and "e2e inference: passed" in output, output
    assert "every offered perturbation target was taken: 14" in output, output  # 7 storage, 6 calculation, 1 system


# Llama-3-8B's shape as the page sees it: 32 layers, 32 heads in 8 query groups (rotary, SwiGLU, RMSNorm, no
# biases), 128 positions. Only the widths are shrunk (hidden 128, 4 values per head), which changes no matrix the
# attention, attribution, logit lens or PCA views draw, so that a CPU generates the 96 tokens in seconds. The
# tiny server's flags, these after them (the last of a repeated flag counts).
LLAMA_SHAPED_SERVER = [*TINY_SERVER, "--num-layers", "32", "--num-attention-heads", "32", "--hidden-size", "128",
                       "--ffn-hidden-size", "448", "--group-query-attention", "--num-query-groups", "8",
                       "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
                       "--disable-bias-linear", "--seq-length", "128", "--max-position-embeddings", "128",
                       # the recording client reads every frame; none may be dropped while it keeps up
                       "--ws-send-queue-frames", "100000"]


def test_page_at_scale_in_a_real_browser(built, chromium):
    """A 128-token generation of the Llama-shaped model with attention at every layer and head, recorded from the
    real server and replayed to the page at wire speed: every view shows all of it within 2 s of the last frame."""
    output = page_against_a_server("e2e/scale.mjs", LLAMA_SHAPED_SERVER, chromium)
    assert "rendered every view" in output and "e2e scale: passed" in output, output
    print(next(line for line in output.splitlines() if "rendered every view" in line))  # the figure, in CI's log


def start_training(save_dir):
    """A tiny GPT training on mock data with --training-ws-port, waiting for a client to start it
    (--training-ws-wait); returns (job, ws URL, output lines)."""
    port = free_port()
    args = [*TINY_GPT, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--train-iters", "100000", "--lr-decay-iters", "100000", "--save", str(save_dir),
            "--save-interval", "100000", "--training-ws-port", str(port), "--training-ws-wait"]
    job = subprocess.Popen(torchrun_command(1, "pretrain_gpt.py", args), cwd=REPO, env=child_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, listening = [], threading.Event()

    def read():
        for line in job.stdout:
            lines.append(line)
            if "MegaScope training server on" in line:
                listening.set()
        listening.set()  # exited

    threading.Thread(target=read, daemon=True).start()
    if not listening.wait(300) or job.poll() is not None:
        kill_process_tree(job.pid)
        job.wait()
        raise AssertionError("the training run did not start its WebSocket:\n" + "".join(lines[-40:]))
    url = re.search(r"MegaScope training server on (ws://\S+)", "".join(lines)).group(1)
    return job, url, lines


def test_training_in_a_real_browser(built, chromium, tmp_path):
    job, url, lines = start_training(tmp_path / "checkpoints")
    try:
        output = run_in_page(NODE, "e2e/training.mjs", env={"MEGASCOPE_WS": url, "CHROMIUM": chromium})
        assert "e2e training: passed" in output, output
        # The page's Stop saves a checkpoint and ends the run cleanly.
        assert job.wait(timeout=300) == 0, "".join(lines[-40:])
        assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").exists()
    finally:
        if job.poll() is None:
            kill_process_tree(job.pid)
        job.wait()
