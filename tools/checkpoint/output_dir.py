"""Where a conversion writes: never over an existing checkpoint, and all at once (atomically)."""

import contextlib
import os
import shutil
import tempfile

from megatron.training.errors import UserError

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
    """Yields a temporary directory beside ``save_dir`` that becomes ``save_dir`` when the block
    completes; a failure leaves nothing at ``save_dir``."""
    check_new_output(save_dir)
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    work_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(save_dir)}.converting-", dir=parent)
    try:
        yield work_dir
        os.chmod(work_dir, 0o777 & ~_umask())  # mkdtemp made it private; the result is an ordinary directory
        os.rename(work_dir, save_dir)  # replaces an empty directory, fails on anything else
    finally:
        if os.path.exists(work_dir):
            shutil.rmtree(work_dir)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
