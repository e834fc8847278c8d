"""The flags that define a checkpoint's model, recorded in every checkpoint (``model_args`` in its common
state) and checked against the launch before any tensor is read, as Megatron-LM's ``check_checkpoint_args``
does: loaded into a model of another head count, a checkpoint's tensors fit and it trains and generates
silently wrong; of another hidden size, megatron-core fails with a long exception that names no flag.

Rotary base, rope scaling and norm epsilon are left out: fine-tuning may change them on purpose.
"""

import os

from megatron.training.errors import UserError

# The argument groups (megatron/training/arguments.py) whose flags define a checkpoint's model and tokenizer:
# recorded as a command line in every checkpoint (``model_flags``), so that --use-checkpoint-args launches a
# generation tool from --load and the layout alone, as Megatron-LM's does.
RECORDED_GROUPS = ("model", "tokenizer")
# Flags naming files: recorded absolute; a relative one (a converted checkpoint's own tokenizer) is the checkpoint
# folder's.
PATH_FLAGS = ("--tokenizer-model", "--vocab-file", "--merge-file")

# args attribute -> how the user sets it (validate_args fills the defaults: ffn size, kv channels, groups)
MODEL_FLAGS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels",
    "max_position_embeddings": "--max-position-embeddings",
    "position_embedding_type": "--position-embedding-type",
    "normalization": "--normalization",
    "swiglu": "--swiglu",
    "add_bias_linear": "linear biases (--disable-bias-linear turns them off)",
    "add_qkv_bias": "--add-qkv-bias",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
}


def model_args(args):
    return {name: getattr(args, name) for name in MODEL_FLAGS}


def model_flags(args, parser) -> list[str]:
    """The command line of ``args``' model and tokenizer flags that differ from ``parser``'s defaults (the
    required ones always); parsed again, it builds the same model with the same tokenizer."""
    flags: list[str] = []
    groups = [group for group in parser._action_groups if group.title in RECORDED_GROUPS]
    for action in (action for group in groups for action in group._group_actions):
        value = getattr(args, action.dest, action.default)
        if value is None or (value == action.default and not action.required):
            continue
        if action.nargs == 0:  # store_true / store_false: given, since the value is not the default
            flags.append(action.option_strings[0])
        else:
            shown = os.path.abspath(value) if action.option_strings[0] in PATH_FLAGS else str(value)
            flags += [action.option_strings[0], shown]
    return flags


def differing_model_flags(saved, args, there: str = "there", here: str = "here") -> list[str]:
    """'<flag> <saved value> <there>, <value of args> <here>' for each model flag whose values differ; none when
    ``saved`` is None (a checkpoint saved before checkpoints recorded their model)."""
    if saved is None:
        return []
    return [f"{MODEL_FLAGS[name]} {_shown(value)} {there}, {_shown(getattr(args, name))} {here}"
            for name, value in saved.items() if name in MODEL_FLAGS and value != getattr(args, name)]


def check_model_args(saved, args, directory):
    """A UserError naming every model flag whose value differs from the checkpoint's (None: not recorded)."""
    differing = differing_model_flags(saved, args)
    if differing:
        raise UserError(f"--load: {directory} holds another model: {'; '.join(differing)}; launch with the "
                        f"model flags it was saved with")


def _shown(value):
    return ("on" if value else "off") if isinstance(value, bool) else value
