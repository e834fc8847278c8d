"""Train/valid/test datasets through megatron-core's builder, and the loaders that feed them.

Each data-parallel rank reads its own slice of every global batch; tensor- and pipeline-parallel
peers of one replica read the same samples. Resuming from ``consumed_samples`` continues exactly
where a checkpoint left off.
"""

import atexit
import multiprocessing
import os
import signal

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.utils import get_attr_wrapped_model

from megatron.training.errors import UserError
from megatron.training.signal_handler import STOP_SIGNALS


def split_sample_counts(args):
    """Samples needed by training, by every evaluation, and by the final test."""
    evaluations = args.train_iters // args.eval_interval + 1
    return [
        args.train_iters * args.global_batch_size,
        evaluations * args.eval_iters * args.global_batch_size,
        args.eval_iters * args.global_batch_size,
    ]


def blend_from_args(args):
    """megatron-core blend for --data-path; every prefix must have its .bin and .idx."""
    if args.mock_data:
        return None
    blend = get_blend_from_list(args.data_path)
    for prefix in blend[0]:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise UserError(f"--data-path: {prefix + suffix} does not exist; give the prefix that "
                                f"tools/preprocess_data.py wrote (e.g. gpt_text_document)")
    return blend


def dataset_config_kwargs(args, tokenizer):
    """Fields that every megatron-core dataset config (GPT, BERT) takes from the flags."""
    return dict(random_seed=args.seed, sequence_length=args.seq_length, blend=blend_from_args(args),
                split=args.split, path_to_cache=args.data_cache_path, tokenizer=tokenizer)


def sum_and_count(values, mask):
    """A loss to report as (sum, count): summed over microbatches and replicas, then divided."""
    return torch.stack([torch.sum(values * mask).detach(), mask.sum()])


_SPLIT_NAMES = ("train", "validation", "test")


def _check_splits_have_documents(args, dataset_class, config, sample_counts):
    """A split asked for samples but given no documents makes megatron-core's index builder loop
    forever (it adds epochs of nothing); say so instead. Shares are rounded as megatron-core does."""
    for prefix in config.blend[0]:
        documents = dataset_class.numel_low_level_dataset(dataset_class.build_low_level_dataset(prefix, config))
        for name, share, samples in zip(_SPLIT_NAMES, config.split_matrix, sample_counts):
            if samples and share is not None and round(share[0] * documents) == round(share[1] * documents):
                raise UserError(
                    f"--split {args.split}: the {name} split of {prefix} gets none of its {documents} "
                    f"documents, yet {samples} samples are needed from it; give it a larger share"
                    + (" or set --eval-iters 0" if name != "train" else ""))


def build_datasets(args, dataset_class, config):
    """(train, valid, test) datasets, built on every rank (megatron-core caches the indices)."""
    sample_counts = split_sample_counts(args)
    if config.blend is not None:
        _check_splits_have_documents(args, dataset_class, config, sample_counts)
    return BlendedMegatronDatasetBuilder(dataset_class, sample_counts, lambda: True, config).build()


class PretrainingSampler:
    """Micro-batches of sample indices for one data-parallel rank, starting at ``consumed_samples``."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size):
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.step = micro_batch_size * dp_size

    def __len__(self):
        return (self.total_samples - self.consumed_samples) // self.step

    def __iter__(self):
        start = self.dp_rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - self.step + 1, self.step):
            yield list(range(first + start, first + start + self.micro_batch_size))


def _ignore_stop_signals(worker_id):
    """Loader workers leave SIGTERM and SIGINT to the trainer, which stops at an agreed iteration,
    saves and then ends them; a launcher that signals the whole process tree, or Ctrl-C in a terminal
    (the whole foreground process group), would kill them mid-batch."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _kill_workers_at_exit():
    """At exit, multiprocessing ends daemonic children with SIGTERM and waits for them. Workers
    ignore SIGTERM, so a process that exits while a loader is still alive (a run stopped by an
    exception, whose traceback keeps the loader) would wait forever: kill them first. atexit runs
    this before multiprocessing's own handler, which was registered earlier. The loader's SIGCHLD
    handler goes first, or it would report the killed workers as a second error."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except ValueError:  # not the main thread: the peer watch ends a rank whose peer died (peer_watch.py)
        pass
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def _loader(args, dataset, consumed_samples):
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, args.micro_batch_size,
                                 parallel_state.get_data_parallel_rank(),
                                 parallel_state.get_data_parallel_world_size())
    if args.num_workers > 0:
        atexit.unregister(_kill_workers_at_exit)  # once, however many loaders
        atexit.register(_kill_workers_at_exit)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=args.num_workers, worker_init_fn=_ignore_stop_signals,
        pin_memory=args.device == "cuda", persistent_workers=args.num_workers > 0,
    )


def _cycle(loader):
    """Evaluation reads its split again and again; training reads its split once."""
    while True:
        yield from loader


def build_data_iterators(args, datasets, consumed_train_samples):
    train, valid, test = datasets
    train_loader = _loader(args, train, consumed_train_samples)
    valid_loader, test_loader = _loader(args, valid, 0), _loader(args, test, 0)
    return (
        iter(train_loader) if train_loader is not None else None,
        _cycle(valid_loader) if valid_loader is not None else None,
        _cycle(test_loader) if test_loader is not None else None,
    )


def next_batch(args, data_iterator, model, every_stage=False):
    """This chunk's next microbatch on the training device, or None on a chunk that reads no data:
    neither first nor last pipeline stage, unless ``every_stage`` (BERT's attention needs the
    padding mask on every stage)."""
    chunk = get_attr_wrapped_model(model, "pre_process"), get_attr_wrapped_model(model, "post_process")
    if not (every_stage or any(chunk)):
        return None
    batch = next(data_iterator)
    if args.device == "cuda":
        batch = {key: value.cuda(non_blocking=True) for key, value in batch.items()}
    return batch
