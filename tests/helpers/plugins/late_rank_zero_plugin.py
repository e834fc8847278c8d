"""A plugin whose flag check fails on every rank but rank 0, which never gets past it: the launch in
which another rank exits first and the launcher stops rank 0 before it could say anything.

Enabled by --fail-checks-except-on-rank-0.
"""

import os
import threading

from megatron.training.errors import ArgumentError


class LateRankZeroPlugin:
    def add_arguments(self, parser):
        parser.add_argument("--fail-checks-except-on-rank-0", action="store_true")

    def is_enabled(self, args):
        return args.fail_checks_except_on_rank_0

    def validate_args(self, args):
        if os.environ.get("RANK") == "0":
            threading.Event().wait()  # until the launcher stops it, once another rank has exited
        raise ArgumentError("late_rank_zero_plugin: this rank's flags are wrong")


PLUGIN = LateRankZeroPlugin()
