"""Podman for the container test, set up the way /work/shared/containers-recipe.sh was seen to work on
CI's machines (Debian, root, no Docker Hub or NGC): the tools by apt-get when missing, the recipe's
runtime settings where this machine needs them, a Debian base image made by debootstrap and kept in
podman's store, and pip's package sources (indexes, wheels, constraints, CA bundle) for the build.

Nothing here writes a system or user containers.conf: where the settings are needed they go into a
file of the test's own, which only the test's podman commands read (CONTAINERS_CONF).
"""

import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.apt_tools import install_missing, last_line

TOOLS = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap"}  # command -> Debian package
BASE_IMAGE = "localhost/megatronapp-ci/debian:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# Podman's default rlimits; a container cannot raise its limits above the host's hard limits.
PODMAN_NOFILE, CONMON_NPROC = 1048576, 32768
CA_IN_BUILD = "/run/megatronapp-ci/ca.crt"  # not over the image's own bundle: ca-certificates' postinst replaces it


def _run(command, **kwargs):
    return subprocess.run(command, check=False, capture_output=True, text=True, **kwargs)


def install_tools() -> None:
    """apt-get the missing tools, or skip with the reason (not root, no apt-get, no network)."""
    install_missing(TOOLS, "container test")


def _hybrid_cgroups() -> bool:
    return Path("/sys/fs/cgroup/unified").is_dir() or not Path("/sys/fs/cgroup/cgroup.controllers").exists()


def _hard_limit(kind: int, cap: int) -> int:
    hard = resource.getrlimit(kind)[1]
    return cap if hard == resource.RLIM_INFINITY else min(hard, cap)


def podman_environment(work_dir: Path) -> dict[str, str]:
    """The environment for podman commands: the recipe's settings where this machine needs them.

    crun refuses hybrid cgroup v1+v2 (runc and cgroupfs work), and podman's default rlimits fail
    above the hard limits of a process without CAP_SYS_RESOURCE.
    """
    nofile = _hard_limit(resource.RLIMIT_NOFILE, PODMAN_NOFILE)
    nproc = _hard_limit(resource.RLIMIT_NPROC, CONMON_NPROC)
    settings = []
    if nofile < PODMAN_NOFILE or nproc < CONMON_NPROC:
        settings += ["[containers]", f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]']
    if _hybrid_cgroups():
        settings += ["[engine]", 'runtime = "runc"', 'cgroup_manager = "cgroupfs"']
    env = dict(os.environ)
    if settings:
        conf = work_dir / "containers.conf"
        conf.write_text("\n".join(settings) + "\n")
        env["CONTAINERS_CONF"] = str(conf)
    probe = _run(["podman", "info"], env=env)
    if probe.returncode != 0:
        pytest.skip(f"container test: podman cannot run here: {last_line(probe)}")
    return env


def ensure_base_image(env: dict[str, str], work_dir: Path) -> str:
    """A minimal Debian bookworm image from debootstrap, made once and kept in podman's store."""
    if _run(["podman", "image", "exists", BASE_IMAGE], env=env).returncode == 0:
        return BASE_IMAGE
    rootfs = work_dir / "rootfs"
    made = _run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), DEBIAN_MIRROR])
    if made.returncode != 0:
        pytest.skip(f"container test: debootstrap of Debian bookworm failed: {last_line(made)}")
    # The host's apt sources (deb822) reach the mirror the way the host does.
    host_sources = Path("/etc/apt/sources.list.d/debian.sources")
    if host_sources.exists():
        shutil.copy(host_sources, rootfs / "etc/apt/sources.list.d/")
        (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = _run(["podman", "import", "--change", 'CMD ["/bin/bash"]', "-", BASE_IMAGE], stdin=tar.stdout, env=env)
    tar.wait()
    shutil.rmtree(rootfs)
    assert imported.returncode == 0, f"podman import of the debootstrapped base failed: {last_line(imported)}"
    return BASE_IMAGE


def _host_pip_settings() -> dict[str, str]:
    """pip's effective settings on this machine (files, then environment), e.g. {'find-links': '/opt/wheels'}."""
    listed = _run([sys.executable, "-m", "pip", "config", "list"]).stdout
    settings = {}
    for scope in ("global", ":env:"):  # the environment overrides the files
        for key, value in re.findall(rf"^{re.escape(scope)}\.([\w-]+)='(.*)'$", listed, re.MULTILINE):
            settings[key] = value
    return settings


def pip_sources_for_build(work_dir: Path) -> list[str]:
    """`podman build` volume options that give pip inside the build this machine's package sources.

    The settings are written to a pip.conf mounted at /etc/pip.conf; the local directories and
    files they name are mounted read-only at their own paths, the CA bundle at a side path.
    """
    settings = _host_pip_settings()
    mounts = {}
    lines = ["[global]"]
    for key, value in settings.items():
        if key == "cert":
            mounts[value] = CA_IN_BUILD
            value = CA_IN_BUILD
        elif key in ("find-links", "constraint"):
            mounts.update({path: path for path in value.split() if os.path.exists(path)})
        elif key in ("extra-index-url", "index-url"):
            # A local index's pages link to files beside its simple/ folder: mount the folder above it.
            for url in value.split():
                if url.startswith("file:///"):
                    root = os.path.dirname(url.removeprefix("file://").rstrip("/"))
                    mounts[root] = root
        lines.append(f"{key} = {value}")
    pip_conf = work_dir / "pip.conf"
    pip_conf.write_text("\n".join(lines) + "\n")
    mounts[str(pip_conf)] = "/etc/pip.conf"
    return [option for host, inside in mounts.items() for option in ("-v", f"{host}:{inside}:ro")]
