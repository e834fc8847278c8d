"""System tools a test needs, apt-get installed where missing (root on Debian), else the test skips saying why."""

import os
import shutil
import subprocess

import pytest


def last_line(result) -> str:
    """The last line a failed command printed (stderr first), or its exit code."""
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {result.returncode}"


def install_missing(tools: dict[str, str], purpose: str) -> None:
    """apt-get the Debian packages of the missing ``tools`` ({command: package}), or skip the test with the
    reason (not root, no apt-get, no network); ``purpose`` starts the skip's line ("container test")."""
    missing = sorted({package for command, package in tools.items() if shutil.which(command) is None})
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{purpose}: {', '.join(missing)} missing and cannot be installed here (needs root and apt-get)")
    wait_for_lock = ["-o", "DPkg::Lock::Timeout=300"]  # another apt-get on the machine finishes first
    for command in (["apt-get", *wait_for_lock, "update", "-q"],
                    ["apt-get", *wait_for_lock, "install", "-y", "-q", *missing]):
        result = subprocess.run(command, check=False, capture_output=True, text=True,
                                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if result.returncode != 0:
            pytest.skip(f"{purpose}: `{' '.join(command)}` failed: {last_line(result)}")
