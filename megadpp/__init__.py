"""MegaDPP: a dynamic pipeline schedule (``--use-dpp``): each pipeline stage runs the next ready
(microbatch, chunk) task chosen by a policy, over asynchronous point-to-point transfers. See
docs/megadpp.md. ``bench/dpp_simulate.py`` runs the same policies on a cost model.

``PLUGIN`` (the training loop's plugin) is built on first access, so that the simulator does not pay
for importing the training loop.
"""


def __getattr__(name):
    if name == "PLUGIN":
        from megadpp.plugin import MegaDPPPlugin

        globals()["PLUGIN"] = MegaDPPPlugin()
        return globals()["PLUGIN"]
    raise AttributeError(f"module 'megadpp' has no attribute {name!r}")
