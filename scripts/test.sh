#!/usr/bin/env bash
# Install what the tests need and run the whole suite (CPU, gloo, multi-process).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
# Lint first (rules in pyproject.toml): a finding stops the run before the half hour of tests.
"$PYTHON" -m ruff check .
"$PYTHON" -m pytest -q tests "$@"
