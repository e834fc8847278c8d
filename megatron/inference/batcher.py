"""Every rank's side of the continuous batch: run the step rank 0 planned (megatron/inference/batch_schedule.py) on
this rank's data-parallel replica, and bring the results of the step before back to rank 0.

A step frees and admits slots (each admitted slot gets its request's sampling parameters), reads the prompt chunks
of the step into their slots, then decodes the replica's decoding rows, all on the slot cache
(megatron/inference/slot_cache.py), queued on the device without waiting. Its draws (and the scores of the positions
read, for requests that ask for log-probabilities) are copied to the host asynchronously; only then does the rank
wait for the step before, whose results rank 0 reads while this step runs on the device. So on a GPU the host's work
per step (planning, streaming tokens, answering) overlaps the model's, and the GPU does not wait for it.

The draws reach rank 0 as they are: the last pipeline stage broadcasts its draw to every stage (so the first stage
embeds the drawn tokens next step, and rank 0, on it, reads them); with several replicas the first rank of each
sends its results to rank 0 over the data-parallel group.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron.inference.host_copy import HostCopy
from megatron.inference.sampling import DrawPlan, SamplingParams
from megatron.inference.scores import position_scores
from megatron.inference.slot_cache import SlotCacheModel
from megatron.training.collectives import gather_objects


class Batcher:
    """Runs planned steps on this rank's replica of ``cache``; ``schedule`` (rank 0 only) reads their results."""

    def __init__(self, cache: SlotCacheModel, schedule=None):
        self.cache = cache
        self.schedule = schedule
        self.device = cache.device
        self.replica = parallel_state.get_data_parallel_rank()
        self.replicas = parallel_state.get_data_parallel_world_size()
        # The ranks that hold a replica's results for rank 0: the first of its tensor- and pipeline-parallel ranks.
        self.reports = (parallel_state.get_tensor_model_parallel_rank() == 0
                        and parallel_state.get_pipeline_model_parallel_rank() == 0)
        self._pending: list[HostCopy | None] = []

    @torch.inference_mode()
    def step(self, message: dict) -> None:
        """Every rank: run ``message`` (one planned step), then hand the step before's results to rank 0."""
        part = message["replicas"].get(self.replica)
        results = self._run(part) if part is not None else {}
        self._pending.append(HostCopy(results) if self.reports else None)
        if len(self._pending) > 1:
            self._report(self._pending.pop(0))

    @torch.inference_mode()
    def flush(self) -> None:
        """Every rank: hand over the results of every step run (the batch has nothing more to run)."""
        while self._pending:
            self._report(self._pending.pop(0))

    @property
    def in_flight(self) -> bool:
        return bool(self._pending)

    def _run(self, part):
        cache = self.cache
        if part["clear"]:
            cache.clear(part["clear"])
        if part["free"]:
            cache.park(part["free"])
        for slot, fields, row in part["admit"]:
            cache.state.params.set([slot], SamplingParams(**fields), [row])
        results = {}
        if part["prefill"] is not None:
            results.update(self._prefill(part["prefill"]))
        if part["decode"] is not None:
            decode = part["decode"]
            output = cache.decode(decode["bucket"], DrawPlan(**decode["plan"]), key_length=decode["key_length"])
            results["decode"] = output.draw
        return results

    def _prefill(self, prefill):
        plan = DrawPlan(**prefill["plan"])
        counts = prefill["counts"]
        tokens = None
        if self.cache.model.pre_process:
            tokens = torch.zeros(len(counts), max(counts), dtype=torch.long)
            for row, chunk in enumerate(prefill["tokens"]):
                tokens[row, :len(chunk)] = torch.tensor(chunk)
        scoring = prefill["targets"] is not None
        output = self.cache.prefill(tokens, prefill["starts"], counts, prefill["slots"], plan,
                                    all_positions=scoring, draw_rows=prefill["draw"])
        results = {"prefill": output.draw}
        if scoring:
            targets = torch.full((len(counts), max(counts)), -1, dtype=torch.long)
            for row, chunk in enumerate(prefill["targets"]):
                targets[row, :len(chunk)] = torch.tensor(chunk)
            results["scores"] = position_scores(output.logits, targets, prefill["best"], self.cache.vocab_size,
                                                self.device)
        return results

    def _report(self, pending):
        """Rank 0 takes the results of the oldest step run (every replica's)."""
        if not self.reports:
            return
        ours = {name: tensor.numpy() for name, tensor in pending.tensors().items()}
        if self.replicas > 1:
            parts = gather_objects(ours, parallel_state.get_data_parallel_group(), 0)
        else:
            parts = [ours]
        if self.schedule is not None:
            self.schedule.take_results(dict(enumerate(parts)) if parts is not None else {})
