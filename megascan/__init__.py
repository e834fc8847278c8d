"""MegaScan: low-overhead tracing of every rank (``--trace``), merged by tools/aggregate.py into one
clock-aligned timeline, with detection of slow GPUs, slow links and hangs. See README and docs/.

``PLUGIN`` (the training loop's plugin) is built on first access, so that the aggregation tool,
which needs only numpy and orjson, does not pay for importing torch and megatron-core.
"""


def __getattr__(name):
    if name == "PLUGIN":
        from megascan.plugin import MegaScanPlugin

        globals()["PLUGIN"] = MegaScanPlugin()
        return globals()["PLUGIN"]
    raise AttributeError(f"module 'megascan' has no attribute {name!r}")
