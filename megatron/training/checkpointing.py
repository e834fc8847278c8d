"""Checkpoints with megatron-core dist_checkpointing in Megatron-LM's layout.

    <save>/latest_checkpointed_iteration.txt      the last complete iteration
    <save>/iter_0000100/                          one dist_checkpointing directory

Sharded tensors carry their global offsets, so a checkpoint loads at another TP/PP size
(the optimizer state in the fully reshardable format). A save is atomic: all ranks write into
``iter_XXXXXXX.inprogress`` which rank 0 renames once every rank is done, then it replaces the
tracker file. A crash mid-save leaves the previous checkpoint as the latest one; a save that fails (a
full disk, a directory that refuses writes) removes its partial directory and stops the job with one line.
"""

import os
import random
import shutil
import time

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from torch.distributed.checkpoint.api import CheckpointException

from megatron.training.arguments import build_parser
from megatron.training.atomic_file import replaced_on_success
from megatron.training.checkpoint_model import PATH_FLAGS, check_model_args, model_args, model_flags
from megatron.training.errors import UserError
from megatron.training.job_lifetime import helper_death_line
from megatron.training.save_dir.checkpoints import (
    TRACKER_FILENAME,
    checkpoint_dir,
    damaged_file,
    read_tracker,
    what_to_do,
)
from megatron.training.save_dir.writable import nearest_existing
from megatron.training.training_log import print_whole_line

IN_PROGRESS_SUFFIX = ".inprogress"
_SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_key(index, model):
    return "model" if len(model) == 1 else f"model{index}"


def _rng_state_object():
    """Per (pipeline, tensor) rank RNG streams; data-parallel replicas hold copies."""
    rng = {
        "random": random.getstate(),
        "np_random": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size())
    return ShardedObject("rng_state", rng, shape, (pp, tp), replica_id=parallel_state.get_data_parallel_rank())


def _restore_rng(rng):
    random.setstate(rng["random"])
    np.random.set_state(rng["np_random"])
    torch.set_rng_state(rng["torch"])
    if rng["device"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["device"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])


def _prepare_torch_adam_for_loading(optimizer):
    """Let megatron-core 0.16's DistributedOptimizer load into PyTorch's Adam (no apex/TE).

    Two gaps on that path: the per-parameter state, 'step' included, appears only at the first
    step, yet building the state dict to load reads 'step'; and loading copies every state entry
    of the destination, 'step' too, from a source that keeps 'step' apart (it is restored from
    the param groups). So: allocate placeholder state (the checkpoint overwrites it) and hand the
    per-parameter copy the destination's own 'step' (a copy onto itself)."""
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        if megatron_optimizer.init_state_fn is None:
            continue
        megatron_optimizer.init_state_fn(megatron_optimizer.optimizer, megatron_optimizer.config)
        for state in megatron_optimizer.optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))
        if hasattr(megatron_optimizer, "_set_main_param_and_optimizer_states"):
            _keep_step_when_loading(megatron_optimizer)


def _keep_step_when_loading(distributed_optimizer):
    copy_states = distributed_optimizer._set_main_param_and_optimizer_states

    def copy_states_keeping_step(model_param, tensors):
        group_index, group_order = distributed_optimizer.model_param_group_index_map[model_param]
        main_param = distributed_optimizer.optimizer.param_groups[group_index]["params"][group_order]
        step = distributed_optimizer.optimizer.state[main_param].get("step")
        if step is not None and "step" not in tensors:
            tensors = {**tensors, "step": step}
        copy_states(model_param, tensors)

    distributed_optimizer._set_main_param_and_optimizer_states = copy_states_keeping_step


def _sharded_state_dict(model, optimizer, scheduler, with_optimizer, with_rng, is_loading):
    state = {}
    for index, chunk in enumerate(model):
        state[_model_key(index, model)] = chunk.module.sharded_state_dict()  # keys without DDP's "module."
    if with_optimizer:
        if is_loading:
            _prepare_torch_adam_for_loading(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading,
                                                          metadata=_SHARDING_METADATA)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_state_object()
    return state


def _layout(args):
    return {"tensor_model_parallel_size": args.tensor_model_parallel_size,
            "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size}


def save_checkpoint(args, iteration, model, optimizer, scheduler, consumed_train_samples):
    start = time.time()
    final_dir = checkpoint_dir(args.save, iteration)
    work_dir = final_dir + IN_PROGRESS_SUFFIX
    rank = torch.distributed.get_rank()
    if rank == 0:
        _start_work_dir(args, iteration, work_dir)
    torch.distributed.barrier()
    state = _sharded_state_dict(model, optimizer, scheduler,
                                with_optimizer=not args.no_save_optim, with_rng=not args.no_save_rng,
                                is_loading=False)
    state.update(iteration=iteration, consumed_train_samples=consumed_train_samples,
                 checkpoint_version=3.0, layout=_layout(args), padded_vocab_size=args.padded_vocab_size,
                 contents={"optimizer": not args.no_save_optim, "rng": not args.no_save_rng},
                 model_args=model_args(args), model_flags=model_flags(args, build_parser("checkpoint")))
    try:
        dist_checkpointing.save(state, work_dir)
    except CheckpointException as error:
        # megatron-core gathers the ranks' write failures and raises on every rank, the details on rank 0
        # only: it removes the partial directory, then every rank stops with its line (whichever prints it).
        message = [_save_failed(args, iteration, work_dir, error) if rank == 0 else None]
        torch.distributed.broadcast_object_list(message, src=0)
        raise UserError(message[0]) from None
    except (OSError, RuntimeError) as error:  # one rank's own write (rank 0's common.pt): the others wait
        if helper_death_line(error) is not None:
            raise  # a data loader's worker killed meanwhile (its SIGCHLD handler raises anywhere): not the save's fault
        raise UserError(_save_failed(args, iteration, work_dir, error)) from None
    torch.distributed.barrier()
    if rank == 0:
        _publish(args, iteration, work_dir, final_dir)
        print_whole_line(f"saved checkpoint at iteration {iteration} to {final_dir} ({time.time() - start:.1f} s)")
    torch.distributed.barrier()


def _start_work_dir(args, iteration, work_dir):
    """A new, empty in-progress directory; one left by a job that died mid-save is kept beside it."""
    try:
        if os.path.exists(work_dir):
            os.rename(work_dir, f"{work_dir}.abandoned-{int(time.time())}")
        os.makedirs(work_dir)
    except OSError as error:
        raise UserError(_save_failed(args, iteration, work_dir, error)) from None


def _publish(args, iteration, work_dir, final_dir):
    """Rename the complete checkpoint into place, then point the tracker at it (rank 0)."""
    try:
        if os.path.exists(final_dir):
            # Same iteration saved before (a rerun): keep the old one beside, never delete it.
            os.rename(final_dir, f"{final_dir}.replaced-{int(time.time())}")
        os.rename(work_dir, final_dir)
        with replaced_on_success(os.path.join(args.save, TRACKER_FILENAME)) as tracker, open(tracker, "w") as f:
            f.write(str(iteration))
    except OSError as error:
        raise UserError(_save_failed(args, iteration, work_dir, error)) from None


def _save_failed(args, iteration, work_dir, error):
    """The line for a save that failed; removes the partial directory this save wrote, if it is still there
    (a failure after the rename into place leaves a complete checkpoint that the tracker does not name)."""
    cause = _first_cause(error)
    removed = ""
    if os.path.exists(work_dir):
        shutil.rmtree(work_dir, ignore_errors=True)
        removed = (f"removed the partial {os.path.basename(work_dir)}; " if not os.path.exists(work_dir)
                   else f"could not remove the partial {work_dir}; ")
    latest = read_tracker(args.save, flag="--save")
    stays = f"iteration {latest} stays the latest checkpoint" if latest is not None else "no checkpoint is saved there"
    free = shutil.disk_usage(nearest_existing(args.save)).free / 1e9
    return (f"--save: the checkpoint of iteration {iteration} could not be written into {args.save} ({cause}; "
            f"{free:.3g} GB free there: a full disk or a directory that refuses writes fails so); {removed}{stays}; "
            f"free space or give another --save, then resume with --load")


def _first_cause(error):
    """'rank R: Type: message' of the first rank's failure in a CheckpointException, else of ``error``."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (error, _) = min(error.failures.items())
        return f"rank {rank}: {_one_line(error)}"
    return _one_line(error)


def _one_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _common_state(load):
    """The common state of the latest checkpoint in ``load``, or None when there is none."""
    iteration = read_tracker(load) if load else None
    common_file = None if iteration is None else os.path.join(checkpoint_dir(load, iteration), "common.pt")
    if common_file is None or not os.path.isfile(common_file):
        return None
    return dist_checkpointing.load_common_state_dict(os.path.dirname(common_file))


def recorded_model_flags(load):
    """--use-checkpoint-args: the model and tokenizer flags the latest checkpoint in ``load`` recorded."""
    common = _common_state(load)
    if common is None:
        raise UserError(f"--use-checkpoint-args: --load {load} holds no checkpoint ({TRACKER_FILENAME} or its "
                        f"common.pt not found); give the directory a training run saved into, or convert.py's "
                        f"--save-dir")
    flags = common.get("model_flags")
    if flags is None:
        raise UserError(f"--use-checkpoint-args: the checkpoint in {load} was saved before checkpoints recorded "
                        f"their flags; leave --use-checkpoint-args out and give its model and tokenizer flags")
    return [os.path.join(load, value) if previous in PATH_FLAGS and not os.path.isabs(value) else value
            for previous, value in zip([None, *flags], flags)]


def use_checkpoint_vocab_padding(args):
    """Build the embedding with the padded vocabulary size of the checkpoint ``--load`` names.

    The padding depends on the tensor-parallel size it was made for, so a checkpoint saved at one TP
    size (or converted from Hugging Face) would not fit the embedding padded for another."""
    common = _common_state(args.load)
    if common is None:
        return  # no checkpoint: load_checkpoint says so, or names what is missing
    padded = common.get("padded_vocab_size")
    if padded is None:
        return  # saved before checkpoints recorded it: padded from the flags, as then
    tp = args.tensor_model_parallel_size
    if padded % tp:
        raise UserError(f"--load: the checkpoint's vocabulary of {padded} rows (padded) cannot be split "
                        f"over --tensor-model-parallel-size {tp}")
    args.padded_vocab_size = padded


def load_checkpoint(args, model, optimizer, scheduler):
    """Load ``--load`` into model/optimizer/scheduler; returns (iteration, consumed train samples)."""
    if args.load is None:
        return 0, 0
    iteration = read_tracker(args.load)
    if iteration is None:
        if torch.distributed.get_rank() == 0:
            print_whole_line(f"no checkpoint in {args.load} ({TRACKER_FILENAME} not found): training from scratch")
        return 0, 0
    directory = checkpoint_dir(args.load, iteration)
    tracker = os.path.join(args.load, TRACKER_FILENAME)
    if not os.path.isdir(directory):
        raise UserError(f"--load: {TRACKER_FILENAME} names iteration {iteration} but {directory} is missing; "
                        f"{what_to_do(args.load, tracker, iteration)}")
    damage = damaged_file(directory)
    if damage:
        raise UserError(f"--load: checkpoint {directory} is damaged: {damage}; "
                        f"{what_to_do(args.load, tracker, iteration)}")
    common = dist_checkpointing.load_common_state_dict(directory)
    same_layout = common.get("layout") == _layout(args)
    if "contents" not in common:
        raise UserError(f"--load: {directory} was not written by MegatronApp's pretrain scripts "
                        f"(no 'contents' entry in its common.pt); convert it or train from scratch")
    check_model_args(common.get("model_args"), args, directory)
    contents = common["contents"]
    with_optimizer = contents["optimizer"] and not (args.no_load_optim or args.finetune)
    # RNG streams belong to (pipeline, tensor) ranks: meaningless in another layout.
    with_rng = contents["rng"] and same_layout and not (args.no_load_rng or args.finetune)
    state = _sharded_state_dict(model, optimizer, scheduler, with_optimizer, with_rng, is_loading=True)
    loaded = dist_checkpointing.load(state, directory)
    for index, chunk in enumerate(model):
        chunk.module.load_state_dict(loaded[_model_key(index, model)], strict=True)
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if with_rng:
        _restore_rng(loaded["rng_state"])
    if torch.distributed.get_rank() == 0:
        print_whole_line(f"loaded checkpoint {directory} (saved at layout {common.get('layout')}; "
                         f"optimizer {'loaded' if with_optimizer else 'not loaded'})")
    if args.finetune:
        return 0, 0
    return loaded["iteration"], loaded["consumed_train_samples"]

