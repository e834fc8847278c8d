"""Per-layer activation and gradient norms of a training iteration, summed over every rank.

activation_norms[l]: the mean over all tokens of the global batch of the L2 norm of layer l's output
(the residual stream after the layer). grad_norms[l]: the L2 norm of the gradient of all of layer l's
parameters. Each rank adds what only it holds (its tensor-parallel shards and sequence slices, its
data-parallel samples; replicated values once), and one all-reduce of a small host tensor sums them,
so every layout reports the same numbers.
"""

import torch
from megatron.core import parallel_state

from megascope.hook_sites import global_layer_index
from megascope.hooks import ModuleHooks, unwrap_model
from megatron.training.layout_invariant_init import global_parameter_names


class LayerStatistics(ModuleHooks):
    def __init__(self, model_chunks, num_layers, distributed_optimizer):
        super().__init__()
        self.models = [unwrap_model(chunk) for chunk in model_chunks]
        self.num_layers = num_layers
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.sequence_parallel = self.models[0].config.sequence_parallel
        # A distributed optimizer leaves each data-parallel rank only its shard of every reduced gradient.
        self.grads_known = not distributed_optimizer
        self.activation = {}  # layer -> device tensor (sum of token norms, tokens): no host sync per layer

    def install(self):
        for model in self.models:
            for layer in model.decoder.layers:
                index = global_layer_index(layer)
                self.handles.append(layer.register_forward_hook(
                    lambda _m, _i, output, index=index: self._on_layer_output(index, output)))

    @torch.no_grad()
    def _on_layer_output(self, index, output):
        # Whole activations are on every TP rank (counted at TP rank 0), sequence slices on each.
        if self.tp_rank != 0 and not self.sequence_parallel:
            return
        hidden = output[0] if isinstance(output, tuple) else output
        norms = hidden.float().norm(dim=-1)
        stat = torch.stack([norms.sum(), torch.tensor(float(norms.numel()), device=norms.device)]).double()
        self.activation[index] = self.activation[index] + stat if index in self.activation else stat

    def _activation_sums(self):
        sums = torch.zeros(self.num_layers, 2, dtype=torch.float64)
        for index, stat in self.activation.items():
            sums[index] = stat.cpu()
        self.activation = {}
        return sums

    def _grad_squares(self):
        squares = [0.0] * self.num_layers
        if not self.grads_known or parallel_state.get_data_parallel_rank() != 0:
            return torch.tensor(squares, dtype=torch.float64)  # data-parallel replicas hold the same gradients
        for model in self.models:
            names = global_parameter_names(model)
            for name, param in model.named_parameters():
                parts = names[name].split(".")
                if parts[:2] != ["decoder", "layers"]:
                    continue
                grad = getattr(param, "main_grad", None)
                grad = param.grad if grad is None else grad
                if grad is None or (self.tp_rank != 0 and not getattr(param, "tensor_model_parallel", False)):
                    continue
                squares[int(parts[2])] = squares[int(parts[2])] + grad.float().square().sum()
        return torch.tensor([float(x) for x in squares], dtype=torch.float64)

    def reduce(self, lm_loss, group):
        """Collective over ``group`` (every rank): (activation norms, grad norms or None, lm loss or None)."""
        has_loss = lm_loss is not None and parallel_state.get_tensor_model_parallel_rank() == 0 and \
            parallel_state.get_data_parallel_rank() == 0
        loss = torch.tensor([float(lm_loss) if has_loss else 0.0, float(has_loss)], dtype=torch.float64)
        totals = torch.cat([self._activation_sums().flatten(), self._grad_squares(), loss])
        torch.distributed.all_reduce(totals, group=group)
        layers = self.num_layers
        sums, counts = totals[:2 * layers].view(layers, 2).unbind(dim=1)
        activation_norms = (sums / counts.clamp(min=1)).tolist()
        grad_norms = totals[2 * layers:3 * layers].sqrt().tolist() if self.grads_known else None
        lm = totals[-2].item() if totals[-1] > 0 else None
        return activation_norms, grad_norms, lm
