#!/usr/bin/env bash
# Install what the tests need and run the whole suite (CPU, gloo, multi-process).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
"$PYTHON" -m pytest -q tests "$@"
