"""Simulated MegaScan traces with their ground truth, for the tests and benchmarks of aggregation and detection
(offline, plain Python and numpy: no torch, no GPU).

synthetic_traces (per-rank trace directories of a GPT step laid out on one clock) -> one_f_one_b (what one
pipeline stage runs in an iteration) -> training_simulator (every rank of a DP x TP x PP job on one global
clock) -> simulated_traces (those runs written as trace files, with slow GPUs, hosts, links or a hang injected)
-> detection_cases (the case matrix, and the check that a report names exactly what was injected).
"""
