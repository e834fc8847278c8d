"""A plugin that holds rank 0 after its setup, before the datasets' build, once it has said so: the other ranks then
wait for it in start-up (the build's barrier) for as long as it is held, so a test that kills rank 0 there finds
them in start-up whatever the machine's pace.

Enabled by --stall-rank-0-after-setup.
"""

import os
import threading

from megatron.training.training_log import print_whole_line


class StalledStartPlugin:
    def add_arguments(self, parser):
        parser.add_argument("--stall-rank-0-after-setup", action="store_true")

    def is_enabled(self, args):
        return args.stall_rank_0_after_setup

    def after_setup(self, context, model, optimizer, scheduler):
        if os.environ.get("RANK") == "0":
            print_whole_line("stalled_start_plugin: rank 0 holds before its datasets")
            threading.Event().wait()  # until it is killed


PLUGIN = StalledStartPlugin()
