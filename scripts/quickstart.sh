#!/usr/bin/env bash
# The main job on the embedded default: install, then scripts/quickstart_job.sh (sample data, a small
# GPT at TP2 x PP2 with MegaScan tracing, a checkpoint, the merged traces and the detection report).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
PYTHON="$PYTHON" bash scripts/quickstart_job.sh "$@"
