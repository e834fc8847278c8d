#!/usr/bin/env bash
# Cost of MegaScope's training mode with nobody connected (docs/benchmarks.md): GPT 345M bf16 on one GPU,
# runs with and without --training-ws-port alternating for ROUNDS rounds (3), ITERS iterations each (60);
# a run's figure is the mean "elapsed time per iteration" of its log windows after the first 20 iterations
# (warm-up and CUDA graph capture). Prints one line per run and the ratio of the means.
#   RESULTS=DIR bash bench/megascope_training_overhead.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh
ITERS=${ITERS:-60}
for round in $(seq "${ROUNDS:-3}"); do
    for mode in off on; do
        extra=()
        [[ $mode == on ]] && extra=(--training-ws-port $((20000 + RANDOM % 20000)))
        log=$RESULTS/training_ws_${mode}_$round.log
        timeout 300 torchrun --nproc_per_node 1 pretrain_gpt.py "${MODEL[@]}" --train-iters "$ITERS" \
            "${extra[@]}" > "$log" 2>&1 || { echo "$mode round $round failed: see $log"; tail -3 "$log"; }
        python3 - "$log" "$mode" <<'PY'
import re, sys
path, mode = sys.argv[1:]
windows = [(int(i), float(ms)) for i, ms in re.findall(r"iteration +(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)",
                                                       open(path).read())]
after = [ms for i, ms in windows if i > 20]
print(f"{mode}: {sum(after) / max(len(after), 1):.1f} ms/iteration over {len(after)} windows ({path})")
PY
    done
done | tee "$RESULTS/training_ws_summary.txt"
python3 - "$RESULTS/training_ws_summary.txt" <<'PY'
import re, sys
runs = re.findall(r"^(on|off): ([0-9.]+) ms", open(sys.argv[1]).read(), re.M)
mean = {mode: sum(float(ms) for m, ms in runs if m == mode) / max(1, sum(m == mode for m, _ in runs)) for mode in ("off", "on")}
print(f"mean off {mean['off']:.1f} ms, on {mean['on']:.1f} ms: with the port and no client {100 * (mean['on'] / mean['off'] - 1):+.2f} %")
PY
