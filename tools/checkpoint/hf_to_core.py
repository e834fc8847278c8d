"""Hugging Face Llama-family checkpoint -> megatron-core distributed checkpoint in Megatron-LM's layout.

Shards are read one after the other, each tensor copied out of the memory-mapped file in the
target dtype. megatron-core's dist_checkpointing saves a whole state dict at once (its writer
holds every tensor it writes, cloning views of larger storages), so the peak host memory is about
the converted model once, not one shard plus one layer (measured: 746 MB peak RSS for a 320 MB
bf16 model in 100 MB shards, of which 357 MB is the imports).
"""

import json
import os
import time

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from safetensors import safe_open

import core_layout
import llama_tensors
from llama_config import check_layout, llama_shape, read_config
from megatron.training.checkpointing import TRACKER_FILENAME, checkpoint_dir
from megatron.training.errors import UserError
from output_dir import copy_hf_side_files, written_atomically

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


class LayerAssembler:
    """Collects HF tensors as they are read and turns each complete layer into our tensors."""

    def __init__(self, shape, templates, padded_vocab_size):
        self.shape, self.templates, self.padded_vocab_size = shape, templates, padded_vocab_size
        self.wanted = {}  # HF name -> (layer or None, part)
        for layer in range(shape.num_layers):
            for part, name in llama_tensors.hf_layer_names(layer, shape.qkv_bias).items():
                self.wanted[name] = (layer, part)
        self.wanted[llama_tensors.HF_EMBEDDING] = (None, "embedding.word_embeddings.weight")
        self.wanted[llama_tensors.HF_FINAL_NORM] = (None, "decoder.final_layernorm.weight")
        if not shape.tied_embeddings:
            self.wanted[llama_tensors.HF_OUTPUT] = (None, "output_layer.weight")
        self.pending = {}  # layer -> {part: tensor}
        self.state = {}  # our state key -> ShardedTensor or [ShardedTensor, ...]

    def add(self, name, tensor):
        if name not in self.wanted:
            return False  # e.g. rotary inv_freq buffers some checkpoints carry
        layer, part = self.wanted.pop(name)
        if layer is None:
            self._add_model_level(part, tensor)
            return True
        parts = self.pending.setdefault(layer, {})
        parts[part] = tensor
        if len(parts) == len(llama_tensors.hf_layer_names(layer, self.shape.qkv_bias)):
            for suffix, value in llama_tensors.megatron_layer(self.pending.pop(layer), self.shape).items():
                self._place(f"decoder.layers.{layer}.{suffix}", value)
        return True

    def _add_model_level(self, key, tensor):
        if key != "decoder.final_layernorm.weight":
            tensor = llama_tensors.padded_rows(tensor, self.padded_vocab_size)
        self._place(key, tensor)
        if key == "embedding.word_embeddings.weight" and self.shape.tied_embeddings:
            self._place("output_layer.weight", tensor)  # our model keeps an untied copy

    def _place(self, key, value):
        template = self.templates[key]
        if isinstance(template, list):
            self.state[key] = [core_layout.with_data(t, v) for t, v in zip(template, value, strict=True)]
        else:
            self.state[key] = core_layout.with_data(template, value)

    def finished_state(self):
        if self.wanted:
            raise UserError(f"the checkpoint lacks {len(self.wanted)} tensors the model needs, "
                            f"e.g. {next(iter(self.wanted))}")
        extra = {key: value for key, value in self.templates.items()
                 if not isinstance(value, (ShardedTensor, list))}  # extra state objects
        return {**extra, **self.state}


def read_shards(files, assembler, dtype):
    for number, path in enumerate(files, 1):
        start, count, size = time.time(), 0, 0
        with safe_open(path, framework="pt") as shard:
            for name in shard.keys():
                # A copy: the file stays mapped only while its shard is read.
                tensor = shard.get_tensor(name).to(dtype, copy=True)
                if assembler.add(name, tensor):
                    count += 1
                    size += tensor.numel() * tensor.element_size()
        seconds = max(time.time() - start, 1e-9)
        print(f"shard {number}/{len(files)} {os.path.basename(path)}: {count} tensors, {size / 1e9:.3f} GB "
              f"in {seconds:.1f} s ({size / 1e9 / seconds:.2f} GB/s)", flush=True)


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
    if not os.path.exists(options.tokenizer_model):
        raise UserError(f"--tokenizer-model {options.tokenizer_model} does not exist")
    padded_vocab_size = shape.padded_vocab_size(options.make_vocab_size_divisible_by, tp)
    dtype_flags = ["--bf16"] if options.bf16 else ["--fp16"] if options.fp16 else []
    with written_atomically(options.save_dir) as work_dir:
        core_layout.start_single_process_group()
        args = core_layout.model_args(shape.megatron_flags(), padded_vocab_size, dtype_flags)
        assembler = LayerAssembler(shape, core_layout.checkpoint_templates(args), padded_vocab_size)
        read_shards(files, assembler, args.params_dtype)
        state = assembler.finished_state()
        state.update(iteration=ITERATION, consumed_train_samples=0, checkpoint_version=3.0,
                     layout={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                             "virtual_pipeline_model_parallel_size": None},
                     padded_vocab_size=padded_vocab_size, contents={"optimizer": False, "rng": False},
                     converted_from=os.path.abspath(options.load_dir))
        start = time.time()
        iteration_dir = checkpoint_dir(work_dir, ITERATION)
        os.makedirs(iteration_dir)
        dist_checkpointing.save(state, iteration_dir)
        print(f"saved the megatron-core checkpoint in {time.time() - start:.1f} s", flush=True)
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
