"""Where a conversion writes: never over an existing checkpoint, and all at once (atomically)."""

import contextlib
import errno
import os
import shutil

from torch.distributed.checkpoint.api import CheckpointException

from megatron.training.errors import UserError
from megatron.training.save_dir.conversion_staging import StagingDirectory

# Files of a Hugging Face tokenizer (and generation defaults) that travel with the weights.
HF_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "chat_template.jinja", "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json")


def check_new_output(save_dir):
    if not os.path.exists(save_dir):
        return
    if not os.path.isdir(save_dir):
        raise UserError(f"--save-dir {save_dir} exists and is not a directory")
    content = os.listdir(save_dir)
    if content:
        holds = ("already holds a checkpoint" if {"latest_checkpointed_iteration.txt", "config.json"} & set(content)
                 else "is not empty")
        raise UserError(f"--save-dir {save_dir} {holds}; it is never overwritten: name a new directory")


@contextlib.contextmanager
def written_atomically(save_dir):
    """Yields a hidden directory beside ``save_dir`` (``staging.StagingDirectory``) that becomes ``save_dir`` when
    the block completes. A failure, SIGTERM or Ctrl-C leaves nothing; a place that takes no more data (a full
    disk, a read-only one) is a UserError naming --save-dir."""
    staging = StagingDirectory(save_dir)
    with staging.removed_on_signals():
        try:
            staging.create()
            check_new_output(save_dir)  # after the claim: no other conversion fills it from now on
            try:
                yield staging.path
            except UserError:
                raise
            except (Exception, CheckpointException) as error:  # DCP wraps a failed write in a BaseException
                reason = _refused_write(error, staging.path)
                if reason is None:
                    raise
                raise UserError(f"--save-dir {save_dir}: writing in {staging.parent} failed ({reason}); nothing "
                                f"was written: free space there or choose another --save-dir") from None
            try:
                staging.publish()
            except OSError:
                check_new_output(save_dir)  # something was put there meanwhile: says what
                raise
        finally:
            staging.remove()


# The errors of a write that the place refused: a full disk or quota, a file-size limit, a read-only or
# forbidden place.
_REFUSED_WRITES = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}
_TRIAL_WRITE_BYTES = 8 << 20


def _refused_write(error, directory):
    """Why ``directory`` takes no more data, if that is what ``error`` came of: the error's own reason where it
    is an OSError of a refused write, else that of a trial write there (torch's and safetensors' writers report
    a failed write as a RuntimeError or an error of their own, without its errno). None if writing works."""
    if (isinstance(error, OSError) and error.errno in _REFUSED_WRITES
            and (error.filename is None or os.fsdecode(error.filename).startswith(directory))):  # not an input's
        return error.strerror
    trial = os.path.join(directory, ".write-check")
    try:
        with open(trial, "wb") as f:
            f.write(bytes(_TRIAL_WRITE_BYTES))
            f.flush()
            os.fsync(f.fileno())  # some file systems (NFS) report a full disk only here
    except OSError as failure:
        return failure.strerror or str(failure)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(trial)
    return None


# What HuggingFaceTokenizer (transformers' AutoTokenizer) loads a tokenizer from: one of these in a folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_tokenizer(source):
    """--tokenizer-model: a tokenizer file, or a folder holding one (not found, the converted checkpoint would
    fail only when it is loaded)."""
    if not os.path.exists(source):
        raise UserError(f"--tokenizer-model {source} does not exist")
    if os.path.isdir(source) and not any(os.path.isfile(os.path.join(source, f)) for f in TOKENIZER_FILES):
        raise UserError(f"--tokenizer-model {source}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)}); "
                        f"give the folder of the model's tokenizer with --tokenizer-model")


def copy_hf_side_files(source, destination):
    """Copy the tokenizer (a folder's known files, or the one file named) into ``destination``."""
    os.makedirs(destination, exist_ok=True)
    if os.path.isfile(source):
        shutil.copy(source, destination)
        return
    for name in HF_SIDE_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), destination)
