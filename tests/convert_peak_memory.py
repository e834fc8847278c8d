"""Run tools/checkpoint/convert.py in this process and print its peak resident memory above what
the process held once the conversion's modules were imported: {"baseline": bytes, "peak": bytes}.

    python tests/convert_peak_memory.py <convert.py flags>
"""

import json
import os
import sys

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "checkpoint")
sys.path.insert(0, TOOLS)
import convert  # noqa: E402
import core_to_hf  # noqa: E402,F401  imported before the baseline: their imports are not the conversion's
import hf_to_core  # noqa: E402,F401


def _status_bytes(field):
    """VmRSS (now) or VmHWM (the peak) of this process image: not getrusage's ru_maxrss, which an
    exec'd child inherits from the parent it was forked from (pytest, holding a model)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB


def main():
    baseline = _status_bytes("VmRSS")
    sys.argv = [os.path.join(TOOLS, "convert.py"), *sys.argv[1:]]
    try:
        convert.main()
    except SystemExit as exit_:
        if exit_.code:
            raise
    peak = _status_bytes("VmHWM")
    print(json.dumps({"baseline": baseline, "peak": peak}), flush=True)


if __name__ == "__main__":
    main()
