"""megatron-core distributed checkpoint of our GPT -> Hugging Face directory that transformers loads.

The model's config is the Hugging Face config.json the forward conversion keeps in ``<load-dir>/hf``
(or ``--hf-config-dir`` for a checkpoint trained from it elsewhere). Each tensor is loaded right before
it is written (dist_checkpointing loads any part of a checkpoint): the embedding, one layer at a time,
then the final norm and the output layer; a written shard's tensors are freed. Peak host memory: one
output shard plus one layer, or plus the tensor being read where that is larger (DCP's reader loads a
stored tensor whole, then copies it into ours).
"""

import json
import os

import core_layout
import llama_tensors
import torch
from host_memory import return_freed_memory
from llama_config import llama_shape, read_config
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from safetensors.torch import save_file

from megatron.training.checkpoint_model import differing_model_flags
from megatron.training.checkpointing import TRACKER_FILENAME, checkpoint_dir, read_tracker
from megatron.training.errors import UserError
from megatron.training.save_dir.checkpoints import damaged_file, what_to_do
from megatron.training.save_dir.conversion_output import copy_hf_side_files, written_atomically

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ShardWriter:
    """Writes tensors into model-NNNNN.safetensors files of at most ``max_bytes`` each (a larger
    tensor: a file of its own, as transformers does), and the index. Holds one file's tensors."""

    def __init__(self, directory, max_bytes):
        self.directory, self.max_bytes = directory, max_bytes
        self.buffer, self.buffer_bytes, self.weight_map, self.total_bytes = {}, 0, {}, 0

    def make_room(self, nbytes):
        """Starts a new file unless ``nbytes`` more fit in this one. Called before reading them too,
        so that a full file is not held while they are read."""
        if self.buffer_bytes + nbytes > self.max_bytes:
            self.flush()

    def add(self, name, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        self.make_room(nbytes)
        self.buffer[name] = tensor.contiguous()
        self.buffer_bytes += nbytes

    def flush(self):
        if not self.buffer:
            return
        file_name = f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors"
        save_file(self.buffer, os.path.join(self.directory, file_name), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.buffer, file_name))
        self.total_bytes += self.buffer_bytes
        self.buffer, self.buffer_bytes = {}, 0
        return_freed_memory()  # the file's smaller tensors: not left as holes in the heap

    def close(self):
        self.flush()
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
        with open(os.path.join(self.directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def _read_request(template, dtype):
    """A ShardedTensor that reads ``template``'s place into a new tensor.

    Without a regular grid: megatron-core takes a grid's other cells for other ranks' parts, and in
    a one-process job they would all be this rank's. Without the prepended layer axis (kept as a
    leading dimension of 1): the grid-less path does not support it."""
    prepended = template.prepend_axis_num
    local_shape = (1,) * prepended + tuple(template.local_shape)
    return ShardedTensor(template.key, torch.empty(local_shape, dtype=dtype), dtype, local_shape,
                         template.global_shape, template.global_offset, None, template.replica_id)


def _load(templates, keys, directory, dtype, writer):
    """{key: tensor or [tensors]} of ``keys``, read from the checkpoint in ``directory`` once ``writer``
    has made room for them."""
    wholes = {key: core_layout.joined(templates[key]) if isinstance(templates[key], list) else templates[key]
              for key in keys}
    request = {key: _read_request(whole, dtype) for key, whole in wholes.items()}
    writer.make_room(sum(tensor.data.numel() * tensor.data.element_size() for tensor in request.values()))
    # One layer of the stacked layer tensors is a partial read, which the access check would refuse.
    loaded = dist_checkpointing.load(request, directory, validate_access_integrity=False)
    return {key: _split_like(templates[key], loaded[key].reshape(whole.local_shape)) for key, whole in wholes.items()}


def _split_like(template, tensor):
    if not isinstance(template, list):
        return tensor
    return list(tensor.split([part.local_shape[0] for part in template]))


def _checkpoint_directory(load_dir):
    """The directory of ``load_dir``'s latest checkpoint, refused in one line when a file of it is missing or cut
    short: training and generation refuse it so, where the conversion ended in a trace (or, for a file it does not
    read, wrote a model from a checkpoint no other tool loads)."""
    iteration = read_tracker(load_dir, flag="--load-dir")
    if iteration is None:
        raise UserError(f"--load-dir {load_dir} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    directory = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(directory):
        raise UserError(f"--load-dir {load_dir}: the tracker names iteration {iteration} but {directory} is missing")
    damage = damaged_file(directory)
    if damage:
        tracker = os.path.join(load_dir, TRACKER_FILENAME)
        raise UserError(f"--load-dir: checkpoint {directory} is damaged: {damage}; "
                        f"{what_to_do(load_dir, tracker, iteration, flag='--load-dir')}")
    return directory


def _model_of(shape, common, directory, config_path):
    """Our model's arguments for ``shape`` (the Hugging Face config), refused in one line where the checkpoint
    recorded another model: a config of another layer count, hidden size or head count ended in megatron-core's
    CheckpointingException trace once the first tensor was read."""
    args = core_layout.model_args(shape.megatron_flags(), common["padded_vocab_size"], [])
    differing = differing_model_flags(common.get("model_args"), args, "in the checkpoint", "in the config")
    if differing:
        raise UserError(f"--hf-config-dir: {config_path} does not describe the checkpoint {directory}: "
                        f"{'; '.join(differing)}; give the config of the model it was converted from or trained "
                        f"as (--hf-config-dir)")
    return args


def convert(options):
    directory = _checkpoint_directory(options.load_dir)
    hf_dir = options.hf_config_dir or os.path.join(options.load_dir, "hf")
    config = read_config(hf_dir, "--hf-config-dir")
    config_path = os.path.join(hf_dir, "config.json")
    shape = llama_shape(config, config_path)
    args = _model_of(shape, dist_checkpointing.load_common_state_dict(directory), directory, config_path)
    dtype = torch.bfloat16 if options.bf16 else torch.float16 if options.fp16 else torch.float32
    with written_atomically(options.save_dir) as work_dir, core_layout.single_process_group():
        templates = core_layout.checkpoint_templates(args)
        writer = ShardWriter(work_dir, options.max_shard_size_gb * 1e9)

        def load_one(key):  # read right before it is written: the model is never held whole
            return _load(templates, [key], directory, dtype, writer)[key]

        writer.add(llama_tensors.HF_EMBEDDING, load_one("embedding.word_embeddings.weight")[: shape.vocab_size])
        for layer in range(shape.num_layers):
            keys = core_layout.layer_keys(templates, layer)
            loaded = _load(templates, [k for k in keys if not k.endswith("_extra_state")], directory, dtype, writer)
            prefix = f"decoder.layers.{layer}."
            hf = llama_tensors.hf_layer({k[len(prefix):]: v for k, v in loaded.items()}, shape)
            del loaded  # q, k and v are copies: the fused tensor goes now, not after the next layer's read
            for part, name in llama_tensors.hf_layer_names(layer, shape.qkv_bias).items():
                writer.add(name, hf.pop(part))  # the writer holds it alone: freed with its file
        writer.add(llama_tensors.HF_FINAL_NORM, load_one("decoder.final_layernorm.weight"))
        if not shape.tied_embeddings:
            writer.add(llama_tensors.HF_OUTPUT, load_one("output_layer.weight")[: shape.vocab_size])
        writer.close()
        copy_hf_side_files(options.tokenizer_model or hf_dir, work_dir)
        with open(os.path.join(work_dir, "config.json"), "w") as f:
            json.dump({**config, "dtype": _DTYPE_NAMES[dtype], "torch_dtype": _DTYPE_NAMES[dtype]}, f, indent=2)
    print(f"wrote the Hugging Face model ({shape.architecture}, {len(set(writer.weight_map.values()))} files, "
          f"{writer.total_bytes / 1e9:.3f} GB) to {options.save_dir}", flush=True)
