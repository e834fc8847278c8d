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
"$PYTHON" -m pip install -q -e ".[test]"
