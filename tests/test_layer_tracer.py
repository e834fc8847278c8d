"""Granularity full's layer tracer on a real megatron-core block (one CPU process): the attention
and MLP halves tile every layer's forward and backward, whether a half's backward is timed by its
norm's weight or, for a norm without a trainable weight (frozen here; fused by transformer-engine
elsewhere), by a gradient hook on its input; and uninstalling leaves the layers untouched."""

import subprocess
import sys

import pytest
from helpers.launch import REPO, child_env

from megatron.training.ports import free_port

SCRIPT = """
import os, sys
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.training.cpu_compat import install_cpu_compat
install_cpu_compat()
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megascan.layer_tracer import LayerTracer
from megascan.recorder import Recorder
from megascan.timing import HostTimer
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(0)
config = TransformerConfig(num_layers=3, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
block = TransformerBlock(config, get_gpt_layer_local_spec())
for layer in block.layers:
    for name in sys.argv[2:]:
        getattr(layer, name).weight.requires_grad_(False)
recorder = Recorder(HostTimer())
tracer = LayerTracer(recorder, [block])
tracer.install()
recorder.open_window(0, [1])
for microbatch in range(2):
    recorder.context.set_phase("forward", microbatch, 0)
    output = block(hidden_states=torch.randn(4, 1, 16, requires_grad=True), attention_mask=None)
    recorder.context.set_phase("backward", microbatch, 0)
    output.sum().backward()
tracer.uninstall()
events = {(name, microbatch, layer): (start, end)
          for name, _, microbatch, _, layer, start, end in recorder.close_window().events}
assert len(events) == 2 * 3 * 4, sorted(events)
for microbatch in range(2):
    def half(name, layer):
        return events[(name, microbatch, layer)]
    for layer in (1, 2, 3):
        assert half("attention-forward", layer)[1] == half("mlp-forward", layer)[0]
        assert half("mlp-backward", layer)[1] == half("attention-backward", layer)[0]
        assert half("attention-forward", layer)[0] <= half("attention-forward", layer)[1]
    for layer in (1, 2):
        assert half("mlp-forward", layer)[1] == half("attention-forward", layer + 1)[0]
        assert half("attention-backward", layer + 1)[1] == half("mlp-backward", layer)[0]
    assert half("mlp-forward", 3)[1] <= half("mlp-backward", 3)[0]
assert all("forward" not in module.__dict__ for layer in block.layers for module in (layer, layer.pre_mlp_layernorm))
recorder.open_window(1, [2])
block(hidden_states=torch.randn(4, 1, 16, requires_grad=True), attention_mask=None).sum().backward()
assert recorder.close_window().events == []
print("tiled")
"""


@pytest.mark.parametrize("frozen", [[], ["input_layernorm"], ["pre_mlp_layernorm"]])
def test_halves_tile_each_layer_whichever_way_their_backward_is_timed(frozen):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port()), *frozen], capture_output=True, text=True,
                            cwd=REPO, env=child_env(), timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("tiled"), result.stdout + result.stderr[-3000:]
