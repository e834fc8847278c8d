#!/usr/bin/env bash
# Sourced by quickstart.sh and test.sh: MegatronApp installed (editable) in a virtual environment.
# Sets PYTHON. VENV picks the environment's folder (default .venv in the repository).
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PYTHON="$VENV/bin/python"
# torch goes first, pinned, and only when missing: left to the resolver, `torch>=2.6` on a
# machine without CUDA can pull a multi-GB CUDA build. An existing torch (>= 2.6) is kept.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
# The C++ transport of csrc/ is built against that torch, so the build sees the environment's
# packages (no build isolation, which would fetch a second torch): its build tools come first.
"$PYTHON" -m pip install -q "setuptools>=64" wheel pybind11
"$PYTHON" -m pip install -q --no-build-isolation -e ".[test]"
