"""Hugging Face Llama-family checkpoint -> megatron-core distributed checkpoint in Megatron-LM's layout.

The checkpoint is written by ``streaming_save``: each of our tensors is made from its Hugging Face
tensors (read by ``shard_reader``, in the target dtype) only when the writer comes to it, and
dropped once written. Peak host memory is about the largest tensor and one layer above the imports
(at most one shard and one layer), whatever the model's size; a progress line reports each shard
once all its tensors were read.
"""

import json
import os
import time

import core_layout
import llama_tensors
import torch
from llama_config import check_layout, llama_shape, read_config
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from shard_reader import ShardReader
from streaming_save import StreamingTorchDistSaveStrategy, placeholder

from megatron.training.checkpoint_model import model_args
from megatron.training.checkpointing import TRACKER_FILENAME, checkpoint_dir
from megatron.training.errors import UserError
from megatron.training.save_dir.conversion_output import check_tokenizer, copy_hf_side_files, written_atomically

ITERATION = 1  # Megatron-LM's converter saves iteration 1 too; --finetune restarts at 0


def shard_files(hf_dir):
    """The safetensors files of ``hf_dir``, in name order."""
    if not os.path.isdir(hf_dir):
        raise UserError(f"--load-dir {hf_dir} is not a directory")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        names = ["model.safetensors"]
    else:
        raise UserError(f"--load-dir {hf_dir}: no model.safetensors nor model.safetensors.index.json "
                        f"(only safetensors checkpoints are read)")
    missing = [name for name in names if not os.path.isfile(os.path.join(hf_dir, name))]
    if missing:
        raise UserError(f"--load-dir {hf_dir}: {missing[0]} is listed in the index but missing")
    return [os.path.join(hf_dir, name) for name in names]


def tensor_recipes(shape, templates):
    """{(checkpoint key, global offset): (our template, HF names, combine, pad vocabulary rows)}."""
    recipes = {}

    def add(template, names, combine, pad=False):
        recipes[(template.key, tuple(template.global_offset))] = (template, names, combine, pad)

    for layer in range(shape.num_layers):
        hf_names = llama_tensors.hf_layer_names(layer, shape.qkv_bias)
        for suffix, parts in llama_tensors.megatron_layer_recipes(shape).items():
            template = templates[f"decoder.layers.{layer}.{suffix}"]
            for part_template, (hf_parts, combine) in zip(template if isinstance(template, list) else [template],
                                                          parts, strict=True):
                add(part_template, [hf_names[part] for part in hf_parts], combine)

    unchanged = llama_tensors.unchanged
    add(templates["embedding.word_embeddings.weight"], [llama_tensors.HF_EMBEDDING], unchanged, pad=True)
    add(templates["decoder.final_layernorm.weight"], [llama_tensors.HF_FINAL_NORM], unchanged)
    if not shape.tied_embeddings:  # tied: the model has no output layer weight of its own
        add(templates["output_layer.weight"], [llama_tensors.HF_OUTPUT], unchanged, pad=True)
    return recipes


def _made(recipe, tensors):
    template, _, combine, pad = recipe
    tensor = combine(*tensors)
    return llama_tensors.padded_rows(tensor, template.local_shape[0]) if pad else tensor


def _check_shapes(recipe, shapes):
    """The tensor ``recipe`` makes from tensors of the checkpoint's shapes (on the meta device) has
    the model's shape, or a UserError names the first Hugging Face tensor."""
    template, names, _, _ = recipe
    try:
        made = tuple(_made(recipe, [torch.empty(shapes[name], device="meta") for name in names]).shape)
    except RuntimeError:  # parts that do not fit together
        made = None
    if made != tuple(template.local_shape):
        raise UserError(f"{names[0]} has shape {shapes[names[0]]}, which does not fit the model config.json "
                        f"describes ({template.key} {tuple(template.local_shape)})")


def streamed_state(templates, recipes, reader, dtype):
    """The state dict to save (placeholders for the tensors), the producer of their data, and the
    order to produce them in (that of their first Hugging Face tensor)."""
    def without_data(value):  # extra state objects stay as they are
        if isinstance(value, list):
            return [placeholder(part, dtype) for part in value]
        return placeholder(value, dtype) if isinstance(value, ShardedTensor) else value

    state = {key: without_data(value) for key, value in templates.items()}
    for recipe in recipes.values():  # before anything is written: the writer would bury the message
        _check_shapes(recipe, reader.shapes)

    def produce(key, offset):
        template, names, _, pad = recipe = recipes[(key, offset)]
        rows = template.local_shape[0] if pad else None  # read into the padded rows: no second copy
        return _made(recipe, [reader.read(name, rows) for name in names])

    def order(key, offset):
        return min(reader.position(name) for name in recipes[(key, offset)][1])

    return state, produce, order


def flags_for_users(shape, options, padded_vocab_size, dtype_flags):
    save_dir = os.path.abspath(options.save_dir)
    return (shape.megatron_flags() + dtype_flags +
            ["--tensor-model-parallel-size", str(options.target_tensor_parallel_size),
             "--pipeline-model-parallel-size", str(options.target_pipeline_parallel_size),
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", os.path.join(save_dir, "hf"),
             "--load", save_dir])


def convert(options):
    config_path = os.path.join(options.load_dir, "config.json")
    shape = llama_shape(read_config(options.load_dir), config_path)
    tp, pp = options.target_tensor_parallel_size, options.target_pipeline_parallel_size
    check_layout(shape, tp, pp)
    files = shard_files(options.load_dir)
    check_tokenizer(options.tokenizer_model)
    padded_vocab_size = shape.padded_vocab_size(options.make_vocab_size_divisible_by, tp)
    dtype_flags = ["--bf16"] if options.bf16 else ["--fp16"] if options.fp16 else []
    with written_atomically(options.save_dir) as work_dir, core_layout.single_process_group():
        args = core_layout.model_args(shape.megatron_flags(), padded_vocab_size, dtype_flags)
        templates = core_layout.checkpoint_templates(args)
        recipes = tensor_recipes(shape, templates)
        reader = ShardReader(files, [name for _, names, _, _ in recipes.values() for name in names],
                             args.params_dtype)
        state, produce, order = streamed_state(templates, recipes, reader, args.params_dtype)
        state.update(iteration=ITERATION, consumed_train_samples=0, checkpoint_version=3.0,
                     layout={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                             "virtual_pipeline_model_parallel_size": None},
                     padded_vocab_size=padded_vocab_size, contents={"optimizer": False, "rng": False},
                     model_args=model_args(args), converted_from=os.path.abspath(options.load_dir),
                     # for --use-checkpoint-args; "hf": the tokenizer copied beside it (relative: the folder's)
                     model_flags=shape.megatron_flags() + dtype_flags +
                     ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "hf"])
        start = time.time()
        iteration_dir = checkpoint_dir(work_dir, ITERATION)
        os.makedirs(iteration_dir)
        dist_checkpointing.save(state, iteration_dir, sharded_strategy=StreamingTorchDistSaveStrategy(produce, order))
        print(f"read, converted and saved the tensors in {time.time() - start:.2f} s", flush=True)
        with open(os.path.join(work_dir, TRACKER_FILENAME), "w") as tracker:
            tracker.write(str(ITERATION))
        hf_side = os.path.join(work_dir, "hf")
        copy_hf_side_files(options.tokenizer_model, hf_side)
        for name in ("config.json", "generation_config.json"):
            if os.path.isfile(os.path.join(options.load_dir, name)):
                copy_hf_side_files(os.path.join(options.load_dir, name), hf_side)
        flags = " ".join(flags_for_users(shape, options, padded_vocab_size, dtype_flags))
        with open(os.path.join(work_dir, "model_args.txt"), "w") as f:
            f.write(flags + "\n")
    print(f"converted {shape.architecture} ({shape.num_layers} layers) to {options.save_dir}; "
          f"load it with these pretrain_gpt.py flags (also in {options.save_dir}/model_args.txt):\n{flags}",
          flush=True)
