#!/usr/bin/env bash
# Slow one GPU down by locking its SM clock, undo that, and watch the clocks: fault injection for
# MegaScan on your own cluster (docs/fault_injection.md).
#
#   gpu_control.sh limit <gpu> <MHz>    lock GPU <gpu>'s SM clock at <MHz> (root)
#   gpu_control.sh reset <gpu>          unlock a GPU that this script locked (root)
#   gpu_control.sh monitor [seconds]    print clocks, power, temperature, utilization and throttle
#                                       reasons every second, for <seconds> or until Ctrl-C
#
# reset only unlocks GPUs that limit locked: limit leaves a file per GPU in STATE_DIR, so that the
# script never undoes clock settings an administrator made on purpose.
set -euo pipefail

PROG=${0##*/}
STATE_DIR=${XDG_RUNTIME_DIR:-/tmp}/megascan-gpu-control
MONITOR_FIELDS=timestamp,index,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active
USAGE="usage: $PROG limit <gpu> <MHz> | reset <gpu> | monitor [seconds]"

die() {
    echo "$PROG: $*" >&2
    exit 1
}

usage_error() {
    echo "$USAGE" >&2
    exit 2
}

# Six digits at most: bash arithmetic would silently wrap a longer number.
require_integer() {
    [[ $2 =~ ^[0-9]{1,6}$ ]] || die "$1 must be a non-negative integer, got '$2'"
}

require_nvidia_smi() {
    command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this needs an NVIDIA driver"
}

require_root() {
    [[ $(id -u) -eq 0 ]] || die "run as root (sudo): locking clocks needs administrator rights"
}

require_gpu() {
    local indices
    indices=$(nvidia-smi --query-gpu=index --format=csv,noheader) || die "nvidia-smi cannot list the GPUs"
    grep -qx "$1" <<<"$indices" || die "GPU $1 does not exist (GPUs here: ${indices//$'\n'/ })"
}

limit() {
    local gpu=$1 mhz=$2 max
    require_gpu "$gpu"
    max=$(nvidia-smi -i "$gpu" --query-gpu=clocks.max.sm --format=csv,noheader,nounits) \
        || die "nvidia-smi cannot read GPU $gpu's maximum SM clock"
    max=${max//[[:space:]]/}
    [[ $max =~ ^[0-9]+$ ]] || die "GPU $gpu reports no maximum SM clock ('$max')"
    ((mhz >= 1 && mhz <= max)) || die "$mhz MHz is outside GPU $gpu's SM clock range (1..$max MHz)"
    require_root
    # Root writes here, possibly under /tmp: refuse a directory (or link) that someone else planted.
    [[ -d $STATE_DIR ]] || mkdir -m 700 "$STATE_DIR"
    [[ -O $STATE_DIR && ! -L $STATE_DIR ]] || die "$STATE_DIR belongs to another user; remove it or set XDG_RUNTIME_DIR"
    nvidia-smi -i "$gpu" -lgc "$mhz,$mhz"
    echo "$mhz" >"$STATE_DIR/limited-$gpu"
    echo "GPU $gpu: SM clock locked at $mhz MHz; undo with: $PROG reset $gpu"
}

reset() {
    local gpu=$1
    require_gpu "$gpu"
    [[ -f $STATE_DIR/limited-$gpu ]] \
        || die "GPU $gpu was not limited by $PROG (no $STATE_DIR/limited-$gpu): leaving its clocks alone"
    require_root
    nvidia-smi -i "$gpu" -rgc
    rm -f -- "$STATE_DIR/limited-$gpu"
    echo "GPU $gpu: SM clock unlocked"
}

monitor() {
    local seconds=${1:-} samples=1
    trap 'exit 0' INT # Ctrl-C is the normal way to stop an open-ended monitor
    nvidia-smi --query-gpu="$MONITOR_FIELDS" --format=csv
    while [[ -z $seconds ]] || ((samples < seconds)); do
        sleep 1
        nvidia-smi --query-gpu="$MONITOR_FIELDS" --format=csv,noheader
        samples=$((samples + 1))
    done
}

case ${1:-} in
    limit)
        [[ $# -eq 3 ]] || usage_error
        require_integer gpu "$2"
        require_integer MHz "$3"
        require_nvidia_smi
        limit "$((10#$2))" "$((10#$3))"
        ;;
    reset)
        [[ $# -eq 2 ]] || usage_error
        require_integer gpu "$2"
        require_nvidia_smi
        reset "$((10#$2))"
        ;;
    monitor)
        [[ $# -le 2 ]] || usage_error
        if [[ $# -eq 2 ]]; then
            require_integer seconds "$2"
            ((10#$2 > 0)) || die "seconds must be at least 1, got '$2'"
        fi
        require_nvidia_smi
        monitor "${2:+$((10#$2))}"
        ;;
    -h | --help | help)
        echo "$USAGE"
        ;;
    *)
        usage_error
        ;;
esac
