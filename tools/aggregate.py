"""Merge the per-rank MegaScan trace files of a run into one clock-aligned Chrome/Perfetto trace;
``-d`` names the slow or hung rank. ``python tools/aggregate.py -b TRACE_DIR [-o benchmark.json] [-d]
[--report-json PATH] [--sqlite PATH]``; see docs/megascan_aggregate.md."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing it
    sys.path.insert(0, REPO)

from megascan.aggregate.cli import main  # noqa: E402  (needs the path above)

if __name__ == "__main__":
    sys.exit(main())
