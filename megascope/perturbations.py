"""Seeded, declarative perturbations of a running model (validated, never evaluated).

    {"id", "kind", "target", "noise", "scale", "seed", "layers", "enabled"}

The targets of each kind are the hook sites (megascope/hook_sites.py) that declare it: storage adds noise to the
weights (and biases) of the site's module, in place, until removed (removal restores them bit for bit);
calculation to what the site reads, during every forward; system to the residual stream after each chosen layer
(resid_post; protocol 2 called it resid).

noise: gaussian x + N(0, scale^2); uniform x * U(1 - scale, 1 + scale); bitflip: each bit of the 16-bit
(bf16/fp16) storage flipped with probability `scale` (fp32 tensors: the upper 16 bits, i.e. their
bf16 part); constant x + scale.

Layout invariance: noise is drawn for the whole (unsharded) tensor from a generator seeded by the
perturbation's seed and the tensor's global name (layer numbers of the whole model), then this rank's
shard is taken; activation noise also counts the forwards since the set was applied. So the same
seed perturbs the same numbers at every TP/PP layout.
"""

import zlib
from dataclasses import asdict, dataclass

import torch
from megatron.core import parallel_state

from megascope.errors import ProtocolError, within
from megascope.hook_sites import (
    COLUMNS,
    HOOK_SITES,
    PERTURBATION_TARGETS,
    RENAMED,
    STORAGE,
    current_name,
    full_hook_name,
    site_modules,
)
from megascope.hooks import ModuleHooks, rewrite_at, unwrap_model
from megatron.training.layout_invariant_init import full_shape, global_parameter_names, this_ranks_shard

NOISE_TYPES = ("gaussian", "uniform", "bitflip", "constant")
# A renamed site's noise keeps the name it had when a seed could first target it: the same seed, the same noise.
_NOISE_NAMES = {new: old for old, new in RENAMED.items()}


def _bad(message, field):
    return ProtocolError("bad_field", message, field)


@dataclass(frozen=True)
class Perturbation:
    id: object
    kind: str
    target: str
    noise: str
    scale: float
    seed: int = 0
    layers: tuple | None = None
    enabled: bool = True

    @classmethod
    def from_json(cls, obj):
        if not isinstance(obj, dict):
            raise _bad("a perturbation is a JSON object", "perturbation")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(obj) - known)
        if unknown:
            raise _bad(f"unknown perturbation field {unknown[0]!r}; known: {', '.join(sorted(known))}", unknown[0])
        kind = obj.get("kind")
        if kind not in PERTURBATION_TARGETS:
            raise _bad(f"kind must be one of {', '.join(PERTURBATION_TARGETS)}", "kind")
        target = current_name(obj.get("target"))
        if target not in PERTURBATION_TARGETS[kind]:
            raise _bad(f"target of a {kind} perturbation must be one of {', '.join(PERTURBATION_TARGETS[kind])}",
                       "target")
        noise = obj.get("noise")
        if noise not in NOISE_TYPES:
            raise _bad(f"noise must be one of {', '.join(NOISE_TYPES)}", "noise")
        scale = obj.get("scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (abs(scale) < 1e6):
            raise _bad("scale must be a number of magnitude below 1e6", "scale")
        if noise in ("gaussian", "uniform") and scale < 0 or noise == "bitflip" and not 0 <= scale <= 1:
            raise _bad("scale must be >= 0 (gaussian, uniform) or a rate from 0 to 1 (bitflip)", "scale")
        seed = obj.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise _bad("seed must be an integer from 0 to 2^31 - 1", "seed")
        layers = obj.get("layers")
        if layers is not None and (not isinstance(layers, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)):
            raise _bad("layers must be a list of layer indices (from 0) or null for all", "layers")
        enabled = obj.get("enabled", True)
        if not isinstance(enabled, bool):
            raise _bad("enabled must be true or false", "enabled")
        return cls(obj.get("id"), kind, target, noise, float(scale), seed,
                   None if layers is None else tuple(layers), enabled)

    def to_json(self):
        obj = asdict(self)
        obj["layers"] = None if self.layers is None else list(self.layers)
        return obj

    def wants_layer(self, layer):
        return self.layers is None or layer in self.layers


def parse_perturbations(objs, num_layers, prefix="perturbations"):
    """The Perturbations of a message's list, for a model of ``num_layers`` layers; errors name
    ``<prefix>.<index>.<field>``."""
    checked = []
    for index, obj in enumerate(objs):
        try:
            perturbation = Perturbation.from_json(obj)
            beyond = [layer for layer in perturbation.layers or () if layer >= num_layers]
            if beyond:
                raise _bad(f"layers {beyond} are not layers of this model: use indices from 0 to "
                           f"{num_layers - 1}", "layers")
            checked.append(perturbation)
        except ProtocolError as error:
            raise within(error, f"{prefix}.{index}") from None
    return checked


def _generator(seed, name):
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _bits_type(dtype):
    if dtype in (torch.bfloat16, torch.float16):
        return torch.int16
    if dtype == torch.float32:
        return torch.int32
    raise ValueError(f"bit flips need a bf16, fp16 or fp32 tensor, not {dtype}")


def draw_noise(p, shape, dtype, name):
    """The noise of perturbation ``p`` for a whole tensor of ``shape``, on CPU: additive values
    (gaussian), factors (uniform), XOR masks of the storage bits (bitflip), or None (constant)."""
    generator = _generator(p.seed, name)
    if p.noise == "gaussian":
        return torch.randn(shape, generator=generator) * p.scale
    if p.noise == "uniform":
        return 1 + (torch.rand(shape, generator=generator) * 2 - 1) * p.scale
    if p.noise == "bitflip":
        flips = torch.rand((*shape, 16), generator=generator) < p.scale
        mask = (flips.to(torch.int32) << torch.arange(16, dtype=torch.int32)).sum(dim=-1, dtype=torch.int32)
        bits = _bits_type(dtype)
        return (mask << 16) if bits == torch.int32 else mask.to(torch.int16)  # fp32: its upper (bf16) half
    return None


def apply_noise(values, p, noise):
    """``values`` perturbed by this rank's piece of the drawn noise. Autograd flows through: the noise
    is a constant; flipped bits pass the gradient straight through."""
    if p.noise == "constant":
        return values + p.scale
    if p.noise == "gaussian":
        return values + noise.to(values)
    if p.noise == "uniform":
        return values * noise.to(values)
    bits = _bits_type(values.dtype)
    flipped = (values.detach().contiguous().view(bits) ^ noise.to(values.device)).view(values.dtype)
    return values + (flipped - values).detach() if values.requires_grad else flipped


def _sequence_shard(whole):
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return whole.chunk(tp, dim=0)[parallel_state.get_tensor_model_parallel_rank()]


def _column_shard(whole):
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return whole.chunk(tp, dim=-1)[parallel_state.get_tensor_model_parallel_rank()]


class PerturbationSet(ModuleHooks):
    """The active perturbations of this rank's model chunks; every rank of the job holds the same set."""

    def __init__(self, model_chunks, args=None):
        super().__init__()
        self.models = [unwrap_model(chunk) for chunk in model_chunks]
        self.active = []
        self.originals = {}     # parameter -> its untouched copy (exact restore)
        self.forward_counts = {}

    # -- the set ------------------------------------------------------------------------------
    def replace(self, perturbations):
        self.clear()
        self.active = list(perturbations)
        self.apply_storage()
        for p in self.active:
            if p.enabled and p.kind != STORAGE:
                self._install(p)

    def clear(self):
        self.restore_storage()
        self.remove()
        self.active, self.forward_counts = [], {}

    def as_json(self):
        return [p.to_json() for p in self.active]

    # -- storage ------------------------------------------------------------------------------
    def _storage_parameters(self, p):
        """(global name, parameter) pairs this storage perturbation touches on this rank."""
        site = HOOK_SITES[p.target]
        layers = range(self.models[0].config.num_layers)
        owners = ({site.weights.format(l=layer) for layer in layers if p.wants_layer(layer)} if site.per_layer
                  else {site.weights})
        for model in self.models:
            names = global_parameter_names(model)
            for name, param in model.named_parameters():
                if names[name].rpartition(".")[0] in owners:  # also the last stage's copy of a tied embedding
                    yield names[name], param

    @torch.no_grad()
    def apply_storage(self):
        """Add the storage noise to the weights (saving exact copies first)."""
        for p in self.active:
            if not (p.enabled and p.kind == STORAGE):
                continue
            for global_name, param in self._storage_parameters(p):
                self.originals.setdefault(param, param.detach().clone())
                noise = draw_noise(p, full_shape(param), param.dtype, global_name)
                param.copy_(apply_noise(param, p, None if noise is None else this_ranks_shard(noise, param)))

    @torch.no_grad()
    def restore_storage(self):
        """Put back the exact weights (training: before the optimizer step)."""
        for param, original in self.originals.items():
            param.copy_(original)
        self.originals = {}

    # -- calculation and system ---------------------------------------------------------------
    def _install(self, p):
        site = HOOK_SITES[p.target]
        # Hidden activations are whole on every TP rank, but sequence-split under sequence parallelism; the
        # columns of mlp.post are split over TP.
        split = self.models[0].config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1
        shard, split_dim = (_column_shard, -1) if site.layout == COLUMNS else (_sequence_shard if split else None, 0)
        for model in self.models:
            for layer, module in site_modules(model, site, p.wants_layer):
                name = full_hook_name(_NOISE_NAMES.get(site.name, site.name), layer)
                self.handles.append(rewrite_at(module, site, lambda values, name=name: self._noisy(
                    values, p, name, shard, split_dim)))

    def _noisy(self, values, p, name, shard, split_dim):
        """``values`` with noise drawn for the whole activation (counting forwards since the set was
        applied), of which this rank takes its piece."""
        count = self.forward_counts.get((p, name), 0)
        self.forward_counts[(p, name)] = count + 1
        whole_shape = list(values.shape)
        if shard is not None:
            whole_shape[split_dim] *= parallel_state.get_tensor_model_parallel_world_size()
        noise = draw_noise(p, whole_shape, values.dtype, f"{name}#{count}")
        return apply_noise(values, p, noise if noise is None or shard is None else shard(noise))
