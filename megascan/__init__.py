"""MegaScan: low-overhead tracing of every rank (``--trace``), merged by tools/aggregate.py into one
clock-aligned timeline, with detection of slow GPUs, slow links and hangs. See docs/megascan.md."""

from megascan.plugin import MegaScanPlugin

PLUGIN = MegaScanPlugin()
