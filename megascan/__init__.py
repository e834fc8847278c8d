"""MegaScan: tracing of every rank, a clock-aligned global timeline, and detection of slow ranks."""
