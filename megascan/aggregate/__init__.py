"""MegaScan aggregation (``tools/aggregate.py``): per-rank trace files -> one clock-aligned trace.

loading (read and check the files; each op record and event kept as a trace_records object) -> matching
(the same op on different ranks) -> alignment (one clock) -> merged_trace (the model detection reads) ->
chrome_trace / sqlite_export (outputs). megascan/aggregate_cli.py ties them to detection (megascan/detection/, which
imports this package, never the reverse). User documentation: docs/megascan_aggregate.md.
"""

from megascan.aggregate.merged_trace import MergedTrace, OpInstance, RankTrace, load_and_merge

__all__ = ["MergedTrace", "OpInstance", "RankTrace", "load_and_merge"]
