"""MegaScope: model internals streamed token by token (inference server) and iteration by iteration
(training, ``--training-ws-port``) to a web page, with seeded perturbations. See docs/megascope.md.

``PLUGIN`` (the training loop's plugin) is built on first access, so that importing the library
(capture, reductions, wire format) does not register anything.
"""


def __getattr__(name):
    if name == "PLUGIN":
        from megascope.plugin import MegaScopePlugin

        globals()["PLUGIN"] = MegaScopePlugin()
        return globals()["PLUGIN"]
    raise AttributeError(f"module 'megascope' has no attribute {name!r}")
