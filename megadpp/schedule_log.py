"""What each rank actually ran, per iteration, written with --dpp-log-schedule as JSON:

    {"format": "torch.distributed.pipelining actions", "pp_size": 4, "num_stages": 8,
     "ranks": {"0": {"pp": 0, "tp": 0, "dp": 0}, ...},
     "iterations": [{"iteration": 1, "forward_only": false, "num_microbatches": 8,
                     "actions": {"0": ["0F0", "0F1", "4F0", ...], ...}}, ...]}

Keys of ``ranks`` and ``actions`` are global ranks; each action string is what
``torch.distributed.pipelining.schedules._Action.from_str`` reads (stage = chunk * pp_size + pp rank).
"""

import json

import torch.distributed as dist
from megatron.core import parallel_state

from megatron.training.atomic_file import replaced_on_success


class ScheduleLog:
    def __init__(self, path):
        self.path = path
        self.iteration = 0
        self.entries = []  # this rank's: (iteration, forward_only, microbatches, [action strings])
        self.layout = None

    def record(self, layout, executed, forward_only):
        self.layout = layout
        microbatches = sum(1 for a in executed if a.kind == "F") // layout.chunks
        self.entries.append((self.iteration, forward_only, microbatches,
                             [a.to_str(layout.pp_rank, layout.stages) for a in executed]))

    def write(self):
        """Collective: every rank sends its entries to rank 0, which writes the file atomically."""
        coords = {"pp": parallel_state.get_pipeline_model_parallel_rank(),
                  "tp": parallel_state.get_tensor_model_parallel_rank(),
                  "dp": parallel_state.get_data_parallel_rank()}
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((coords, self.entries), gathered, dst=0)
        if dist.get_rank() != 0:
            return
        iterations = []
        for index, (iteration, forward_only, microbatches, _) in enumerate(self.entries):
            iterations.append({"iteration": iteration, "forward_only": forward_only,
                               "num_microbatches": microbatches,
                               "actions": {str(rank): entries[index][3] for rank, (_, entries) in enumerate(gathered)}})
        document = {"format": "torch.distributed.pipelining actions", "pp_size": self.layout.stages,
                    "num_stages": self.layout.virtual_stages,
                    "ranks": {str(rank): coords for rank, (coords, _) in enumerate(gathered)},
                    "iterations": iterations}
        with replaced_on_success(self.path) as temporary, open(temporary, "w") as out:
            json.dump(document, out)
