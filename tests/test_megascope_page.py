"""MegaScope's page (tools/visualization/transformer-visualize): its vitest unit tests, its production build,
and its end-to-end scenarios in Debian's Chromium (playwright-core) against the real backend: the text
generation server on a tiny model (inference) and a training run with --training-ws-port (training).

Node.js and npm are needed (skipped with the reason when absent); Chromium is installed by apt when missing
and this runs as root (CI), else $CHROMIUM names it. Screenshots go to the page's e2e-artifacts/, or to
$MEGASCOPE_SCREENSHOTS (MEGASCOPE_SCREENSHOTS=docs/images refreshes the README's)."""

import os
import shutil
import subprocess

import pytest

from generation_server import TINY_SERVER, GenerationServer
from launch import REPO, child_env

PAGE = REPO / "tools" / "visualization" / "transformer-visualize"
NPM = shutil.which("npm")
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(not (NPM and NODE), reason="Node.js and npm are not installed: the page's tests need them "
                                                          "(Node 20 and npm; e.g. apt-get install nodejs npm)")


def run_in_page(*command, env=None, timeout=600):
    """Run a command in the page's folder; its output is in the assertion message when it fails."""
    done = subprocess.run(command, cwd=PAGE, env=child_env(env), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
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
            subprocess.run(command, check=True, capture_output=True, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
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


def test_inference_in_a_real_browser(built, chromium):
    server = GenerationServer(1, TINY_SERVER)
    try:
        output = run_in_page(NODE, "e2e/inference.mjs", env={"MEGASCOPE_HTTP": server.rest, "MEGASCOPE_WS": server.ws,
                                                             "CHROMIUM": chromium})
    finally:
        server.stop()
    assert "tokens match REST" in output and "e2e inference: passed" in output, output
