#!/usr/bin/env bash
# Install what the tests need and run the whole suite (CPU, gloo, multi-process).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
# Lint first (rules in pyproject.toml): a finding stops the run before the half hour of tests.
"$PYTHON" -m ruff check .
# The plugin contract and the plugins' hooks type-checked (files and rules: [tool.mypy] in pyproject.toml).
"$PYTHON" -m mypy
"$PYTHON" -m pytest -q tests "$@"
