"""Direct logit attribution: how much the embedding, each layer's attention heads and MLP, and the bias terms
add to the logit of the token a generation step chose.

The residual stream entering the final norm is the sum of the embedding output, each layer's attention output
(its heads through ``linear_proj``, plus ``linear_proj``'s bias) and each layer's MLP output (its ``linear_fc2``
bias included). The final norm is linearised at the actual residual x: its scale s (rms(x) for RMSNorm, the
standard deviation of x for LayerNorm; with the norm's epsilon) is frozen, so a component c adds
(g * center(c) / s) . W_U[t] = c . u with u = center(g * W_U[t] / s), where center subtracts the mean (LayerNorm
only; centering is linear and symmetric, so it moves from c to u), g is the norm's weight and W_U[t] the chosen
token's row of the output layer. The norm's bias adds beta . W_U[t]. The parts sum to the chosen token's logit
y . W_U[t] (y = the final norm's output) up to rounding. Head h adds its slice of ``linear_proj``'s input times
W_O's columns of that head.

Where the data lives: the last pipeline stage builds u per prompt row (the chosen token's output-layer row is on
one tensor-parallel rank of the vocabulary-sharded output layer: summed over the TP group) and broadcasts it to
every stage; each stage dots its own layers' components with it, each TP rank its own heads (gathered over TP),
and the few numbers per layer go to the first rank of the model-parallel group. Everything is in float64.

    with Attribution(model_chunks) as attribution:
        ...one forward step...
        results = attribution.collect(chosen_tokens, rows, position)   # collective; rank 0 gets the results

Only the forward's last position is kept (the one the chosen token's logit is read from).
"""

from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from megascope.distributed import all_gather_along, broadcast_from_last_stage
from megascope.hook_sites import HOOK_SITES, site_modules
from megascope.hooks import ModuleHooks, unwrap_model
from megascope.logit_lens import output_weight
from megascope.wire import encode_data_frame
from megatron.training.collectives import gather_objects

ATTRIBUTION_HOOK = "attribution"
ATTRIBUTION_DIMS = ("token", "layer", "component")  # component: head 0 .. heads-1, then the MLP


@dataclass
class TokenAttribution:
    """One chosen token's attribution: ``values`` [layers, heads + 1] float64 (each head, then the MLP); the
    embedding, each layer's attention-output bias and the final norm's bias as separate terms."""
    prompt_index: int
    position: int          # where the chosen token goes (its logit is read at position - 1)
    token_id: int
    logit: float           # the chosen token's logit: the final norm's output times its output-layer row
    embed: float
    attn_bias: list
    final_norm_bias: float
    values: torch.Tensor

    def total(self) -> float:
        """Every part added up: equals ``logit`` up to rounding."""
        return float(self.values.sum()) + self.embed + sum(self.attn_bias) + self.final_norm_bias

    def data_frame(self, generation_id, step: int) -> bytes:
        """The data frame of docs/megascope_protocol.md ("Direct logit attribution"), float32 values."""
        header = {"id": generation_id, "step": step, "hook": ATTRIBUTION_HOOK, "layer": None,
                  "prompt_index": self.prompt_index, "tokens": [self.position, self.position + 1],
                  "dims": list(ATTRIBUTION_DIMS), "reduction": "none", "token_id": self.token_id,
                  "logit": self.logit, "embed": self.embed, "attn_bias": self.attn_bias,
                  "final_norm_bias": self.final_norm_bias}
        return encode_data_frame(header, self.values[None], dtype="float32")


def _last_position(output):
    """A module's output (with its returned bias added) at the forward's last position, [1, b, hidden]."""
    out, bias = output if isinstance(output, tuple) else (output, None)
    last = out[-1:]
    return (last if bias is None else last + bias).detach().clone()


def linearised_direction(norm, residual, unembedding, config):
    """(u [b, hidden], the norm bias's term [b]) of the final norm linearised at ``residual`` [b, hidden] (float64,
    ``unembedding`` the chosen tokens' output rows); no norm: u is the rows themselves."""
    zeros = torch.zeros(residual.size(0), dtype=torch.float64, device=residual.device)
    if norm is None:
        return unembedding, zeros
    layer_norm = config.normalization == "LayerNorm"
    centred = residual - residual.mean(-1, keepdim=True) if layer_norm else residual
    eps = getattr(norm, "eps", None)
    eps = eps if eps is not None else torch.finfo(norm.weight.dtype).eps  # torch.nn.RMSNorm's default
    scale = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    gamma = norm.weight.double() + (1.0 if config.layernorm_zero_centered_gamma else 0.0)
    direction = gamma * unembedding / scale
    if layer_norm:
        direction = direction - direction.mean(-1, keepdim=True)
    beta = getattr(norm, "bias", None)
    return direction, zeros if beta is None else unembedding @ beta.double()


def unembedding_rows(model, tokens):
    """[b, hidden] float64: each row's chosen token's row of the (vocabulary-sharded) output layer, on every
    tensor-parallel rank. Collective over the TP group."""
    weight = output_weight(model)
    shard = weight.size(0)
    local = tokens.to(weight.device) - parallel_state.get_tensor_model_parallel_rank() * shard
    mine = (local >= 0) & (local < shard)
    rows = torch.zeros(tokens.numel(), weight.size(1), dtype=torch.float64, device=weight.device)
    rows[mine] = weight[local[mine]].double()
    group = parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(rows, group=group)
    return rows


class Attribution(ModuleHooks):
    """Forward hooks that keep what attribution needs at the forward's last position; ``collect`` computes it."""

    def __init__(self, model_chunks):
        super().__init__()
        self.models = [unwrap_model(chunk) for chunk in model_chunks]
        self.config = self.models[0].config
        self.seen = {}
        self.projections = {}  # layer -> its attention's linear_proj
        for model in self.models:
            for _, embedding in site_modules(model, HOOK_SITES["embed"]):
                self._after(embedding, "embed")
            if model.post_process:
                norm = next((module for _, module in site_modules(model, HOOK_SITES["final_norm"])), None)
                self._before(norm or model.output_layer, "residual")
                self._after(norm or model.output_layer, "normed", module_input=norm is None)
            # attn.out's part, per head: each head's slice of linear_proj's input through W_O
            for index, projection in site_modules(model, HOOK_SITES["attn.proj"]):
                self.projections[index] = projection
                self._before(projection, ("heads", index))
            for index, mlp in site_modules(model, HOOK_SITES["mlp.out"]):
                self._after(mlp, ("mlp", index))

    def _before(self, module, key):
        self.handles.append(module.register_forward_pre_hook(
            lambda _m, inputs: self.seen.__setitem__(key, inputs[0][-1:].detach().clone())))

    def _after(self, module, key, module_input=False):
        self.handles.append(module.register_forward_hook(
            lambda _m, inputs, output: self.seen.__setitem__(
                key, _last_position(inputs[0] if module_input else output))))

    def remove(self):
        super().remove()
        self.seen.clear()

    def _hidden(self, key):
        """[b, hidden] float64 at the last position; sequence parallelism puts it on the last TP rank."""
        tensor = self.seen[key]
        if self.config.sequence_parallel:
            tensor = all_gather_along(tensor, 0, parallel_state.get_tensor_model_parallel_group())
        return tensor[-1].double()

    def collect(self, tokens, rows, position):
        """Collective over the model-parallel group, after a forward whose last position chose ``tokens`` [b]:
        on its first rank the TokenAttribution of each row in ``rows`` (``position``: where the chosen tokens
        go), [] elsewhere."""
        tp_group = parallel_state.get_tensor_model_parallel_group()
        device = next(self.models[0].parameters()).device
        batch = tokens.numel()
        last = next((model for model in self.models if model.post_process), None)
        part, direction = {"layers": {}}, None
        if last is not None:
            unembedding = unembedding_rows(last, tokens)
            norm = getattr(last.decoder, "final_layernorm", None)
            direction, norm_bias = linearised_direction(norm, self._hidden("residual"), unembedding, self.config)
            part.update(logit=(self._hidden("normed") * unembedding).sum(-1).cpu(), final_norm_bias=norm_bias.cpu())
        direction = broadcast_from_last_stage(direction, (batch, self.config.hidden_size), torch.float64, device)
        if "embed" in self.seen:
            part["embed"] = (self._hidden("embed") * direction).sum(-1).cpu()
        for layer, projection in sorted(self.projections.items()):
            part["layers"][layer] = self._layer(layer, projection, direction, tp_group)
        first_of_stage = parallel_state.get_tensor_model_parallel_rank() == 0
        received = gather_objects(part if first_of_stage else None, parallel_state.get_model_parallel_group(), 0)
        return [] if received is None else _merge([p for p in received if p is not None], tokens, rows, position)

    def _layer(self, layer, projection, direction, tp_group):
        """(per head [b, heads], MLP [b], attention bias [b]) of one layer, every head gathered over TP."""
        context = self.seen[("heads", layer)][-1].double()             # [b, local heads * d]
        head_dim = self.config.kv_channels
        through = direction @ projection.weight.double()                # u . W_O for each input column
        heads = (context * through).reshape(context.size(0), -1, head_dim).sum(-1)
        heads = all_gather_along(heads, -1, tp_group)
        mlp = (self._hidden(("mlp", layer)) * direction).sum(-1)
        bias = projection.bias
        attn_bias = torch.zeros_like(mlp) if bias is None else direction @ bias.double()
        return heads.cpu(), mlp.cpu(), attn_bias.cpu()


def _merge(parts, tokens, rows, position):
    """Every stage's part -> a TokenAttribution per row."""
    layers, whole = {}, {}
    for part in parts:
        layers.update(part.pop("layers"))
        whole.update(part)
    ordered = [layers[layer] for layer in sorted(layers)]
    values = torch.stack([torch.cat([heads, mlp[:, None]], dim=1) for heads, mlp, _ in ordered], dim=1)
    return [TokenAttribution(prompt_index=row, position=position, token_id=int(tokens[row]),
                             logit=float(whole["logit"][row]), embed=float(whole["embed"][row]),
                             attn_bias=[float(bias[row]) for _, _, bias in ordered],
                             final_norm_bias=float(whole["final_norm_bias"][row]), values=values[row])
            for row in rows]
