"""Merge the per-rank MegaScan trace files of a run into one clock-aligned Chrome/Perfetto trace;
``-d`` names the slow or hung rank. ``python tools/aggregate.py -b TRACE_DIR [-o benchmark.json] [-d]
[--report-json PATH] [--sqlite PATH]``; see docs/megascan_aggregate.md."""

import sys

from megascan.aggregate_cli import main

if __name__ == "__main__":
    sys.exit(main())
