"""--save checked at start-up, not at the first save after --save-interval iterations of work.

- It must be writable (a file, a path under a file, a read-only directory are one line at once).
- A run must not move its tracker backwards: a run that starts before the latest checkpoint there (no
  --load of it, --finetune, or --load of an earlier one elsewhere) would make its own earlier
  iterations the latest ones, without a word. Refused unless --override-save.
- Rank 0 locks it for the job's life (lock.py) and warns when its disk has less room than one
  checkpoint needs (a full disk fails the save; the previous checkpoint stays the latest).
"""

import os
import shutil

from megatron.training.errors import UserError
from megatron.training.flops import layer_matrix_weights
from megatron.training.save_dir.checkpoints import iterations_present, read_tracker
from megatron.training.save_dir.lock import take_save_lock
from megatron.training.save_dir.writable import check_directory_writable, nearest_existing
from megatron.training.training_log import print_whole_line


def check_save_dir(args) -> None:
    """Every rank, before start-up: --save is writable and this run does not rewind its tracker."""
    if args.save is None:
        return
    check_directory_writable(args.save, "--save")
    if not args.override_save:
        _refuse_rewinding(args)


def _refuse_rewinding(args):
    iterations = iterations_present(args.save)
    latest = read_tracker(args.save, flag="--save")
    if latest is None and not iterations:
        return  # nothing saved there yet
    latest = latest if latest is not None else max(iterations)
    if args.load is None or args.finetune:
        start, how = 0, "--finetune" if args.finetune else "no --load"
    else:
        start, how = read_tracker(args.load) or 0, f"--load {args.load}"
    if start >= latest:
        return  # resuming from it (or from later): the tracker only moves forward
    saved = ", ".join(map(str, iterations)) or "none"
    raise UserError(f"--save {args.save} already holds checkpoints (iterations {saved}; the latest is {latest}) and "
                    f"this run starts at iteration {start} ({how}): its saves would make earlier iterations the latest "
                    f"ones; resume with --load {args.save}, give a new --save directory, or add --override-save to "
                    f"save there anyway")


def checkpoint_size_estimate(args) -> int:
    """Bytes of one checkpoint of this model: its weights (matrices and embeddings) in their precision plus,
    unless --no-save-optim, the optimizer's fp32 state (Adam's two moments, SGD's momentum, and the fp32
    master weights of a bf16/fp16 model)."""
    h = args.hidden_size
    parameters = args.num_layers * layer_matrix_weights(args)
    parameters += args.padded_vocab_size * h * (2 if args.untie_embeddings_and_output_weights else 1)
    if args.position_embedding_type == "learned_absolute":
        parameters += args.max_position_embeddings * h
    half = args.bf16 or args.fp16
    per_parameter = 2 if half else 4
    if not args.no_save_optim:
        per_parameter += (4 if half else 0) + (8 if args.optimizer == "adam" else 4)
    return parameters * per_parameter


def short_of_space_warning(save_dir: str, needed_bytes: int) -> str | None:
    """A warning line when the disk of ``save_dir`` has fewer free bytes than ``needed_bytes``, else None."""
    free = shutil.disk_usage(nearest_existing(save_dir)).free
    if free >= needed_bytes:
        return None
    return (f"warning: --save {save_dir}: {_gigabytes(free)} free on its disk, less than the "
            f"{_gigabytes(needed_bytes)} one checkpoint of this model needs (estimated); a save that fills the disk "
            f"fails and the previous checkpoint stays the latest: free space or give another --save")


def _gigabytes(count):
    return f"{count / 1e9:.3g} GB"


def claim_save_dir(args) -> None:
    """On the launch's rank 0, before start-up: lock --save for the job's life and warn on a short disk."""
    if args.save is None or int(os.environ.get("RANK", "0")) != 0:
        return
    take_save_lock(args.save)
    warning = short_of_space_warning(args.save, checkpoint_size_estimate(args))
    if warning:
        print_whole_line(warning)
