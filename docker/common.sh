# Sourced by the docker/DockerUsage_*.sh scripts: OUTPUT_DIR from the first argument (everything a
# script writes goes under it: the code and the image stay untouched), the repository as the working
# directory, PYTHON, and scripts/job_helpers.sh (detect_layout, prepare_sample_data).
set -euo pipefail
SCRIPT=$(basename "$0")
if [ $# -lt 1 ] || [ -z "$1" ]; then
    echo "$SCRIPT: missing OUTPUT_DIR: bash docker/$SCRIPT OUTPUT_DIR [extra flags]; everything it writes goes there" >&2
    exit 2
fi
OUT_DIR=$(realpath -m "$1")
shift
if ! mkdir -p "$OUT_DIR" 2>/dev/null || [ ! -w "$OUT_DIR" ]; then
    echo "$SCRIPT: output directory $OUT_DIR is not writable by uid $(id -u); mount a directory that" \
         "uid may write (on the host: chown $(id -u) DIR) or pass another OUTPUT_DIR" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
source scripts/job_helpers.sh
