"""CaptureSpec: what a client asks to capture, parsed and validated from its JSON form (see
docs/megascope_protocol.md); every mistake is a ProtocolError naming the field."""

from dataclasses import dataclass, field

from megascope.errors import ProtocolError, within
from megascope.hook_sites import CAPTURED, HOOK_SITES, current_name
from megascope.reductions import Reduction

_FIELDS = ("hooks", "layers", "tokens", "reduction", "reductions", "topk", "logit_lens", "pca", "sample", "attribution")
_PCA_FIELDS = ("hook", "layer")
MAX_TOPK = 100


def _bad(message, name):
    return ProtocolError("bad_field", message, name)


def _int(value, name, minimum=0, maximum=None):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise _bad(f"{name} must be an integer {bound}", name)
    return value


def _captured_site(name, field):
    if name not in CAPTURED:
        raise ProtocolError("bad_hook", f"unknown hook {name!r}; known hooks: {', '.join(CAPTURED)}", field)
    return HOOK_SITES[name]


def _range(value, name):
    """[start, end) of non-negative integers, or None for everything."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise _bad(f"{name} must be [start, end) or null", name)
    start, end = (_int(v, name) for v in value)
    if start >= end:
        raise _bad(f"{name}: start {start} must be below end {end}", name)
    return start, end


@dataclass(frozen=True)
class PcaRequest:
    hook: str
    layer: int | None  # None: the hook has no layer, or (a per-layer hook) every captured layer


@dataclass(frozen=True)
class CaptureSpec:
    hooks: tuple = ()
    layers: tuple | None = None
    tokens: tuple | None = None
    reduction: Reduction = Reduction("none")
    reductions: dict = field(default_factory=dict)
    topk: int = 5
    logit_lens: bool = False
    pca: PcaRequest | None = None
    sample: int = 0
    attribution: bool = False  # direct logit attribution of each generated token (megascope/attribution.py)

    @classmethod
    def from_json(cls, obj):
        if not isinstance(obj, dict):
            raise _bad("capture must be an object", "capture")
        unknown = sorted(set(obj) - set(_FIELDS))
        if unknown:
            raise _bad(f"unknown capture field {unknown[0]!r}; known: {', '.join(_FIELDS)}", unknown[0])
        if "hooks" not in obj:
            raise _bad("hooks is required: a list of hook names, [] for none", "hooks")
        hooks = obj["hooks"]
        if not isinstance(hooks, list) or not all(isinstance(h, str) for h in hooks):
            raise _bad(f"hooks must be a list of hook names ({', '.join(CAPTURED)})", "hooks")
        hooks = [current_name(name) for name in hooks]
        for name in hooks:
            _captured_site(name, "hooks")
        reduction = Reduction.parse(obj.get("reduction", "none"), "reduction")
        reductions = obj.get("reductions") or {}
        if not isinstance(reductions, dict):
            raise _bad("reductions must be an object {hook: reduction}", "reductions")
        per_hook = {}
        for name, text in reductions.items():
            name = current_name(name)
            if name not in hooks:
                raise _bad(f"reductions names {name!r}, which is not among the captured hooks", "reductions")
            per_hook[name] = Reduction.parse(text, f"reductions.{name}")
        for name in hooks:
            per_hook.get(name, reduction).check_applies_to(HOOK_SITES[name].dims, name,
                                                           f"reductions.{name}" if name in per_hook else "reduction")
        logit_lens = obj.get("logit_lens", False)
        if not isinstance(logit_lens, bool):
            raise _bad("logit_lens must be true or false", "logit_lens")
        attribution = obj.get("attribution", False)
        if not isinstance(attribution, bool):
            raise _bad("attribution must be true or false", "attribution")
        pca = _pca(obj.get("pca"), hooks)
        pca_reduction = None if pca is None else per_hook.get(pca.hook, reduction)
        if pca_reduction is not None and str(pca_reduction) != "none":
            raise _bad(f"pca.hook {pca.hook!r} is captured with reduction {pca_reduction}, "
                       "but PCA needs its full vectors: capture it with reduction none", "pca.hook")
        return cls(hooks=tuple(dict.fromkeys(hooks)), layers=_range(obj.get("layers"), "layers"),
                   tokens=_range(obj.get("tokens"), "tokens"), reduction=reduction, reductions=per_hook,
                   topk=_int(obj.get("topk", 5), "topk", 1, MAX_TOPK), logit_lens=logit_lens,
                   pca=pca, sample=_int(obj.get("sample", 0), "sample"), attribution=attribution)

    def check_layers(self, num_layers):
        """The layer numbers against a model of ``num_layers`` layers (from_json cannot know the model)."""
        if self.layers is not None and self.layers[1] > num_layers:
            raise _bad(f"layers [{self.layers[0]}, {self.layers[1]}) reaches past this model's {num_layers} "
                       f"layers: use [start, end) with 0 <= start < end <= {num_layers}", "layers")
        if self.pca is not None and self.pca.layer is not None and self.pca.layer >= num_layers:
            raise _bad(f"pca.layer must be from 0 to {num_layers - 1} (this model has {num_layers} layers), "
                       f"not {self.pca.layer}", "pca.layer")

    def to_json(self):
        """The normalised spec (every default filled in), as a client would send it."""
        return {"hooks": list(self.hooks), "layers": None if self.layers is None else list(self.layers),
                "tokens": None if self.tokens is None else list(self.tokens), "reduction": str(self.reduction),
                "reductions": {hook: str(r) for hook, r in self.reductions.items()}, "topk": self.topk,
                "logit_lens": self.logit_lens,
                "pca": None if self.pca is None else {"hook": self.pca.hook, "layer": self.pca.layer},
                "sample": self.sample, "attribution": self.attribution}

    def reduction_for(self, hook):
        return self.reductions.get(hook, self.reduction)

    def wants_layer(self, layer):
        return self.layers is None or self.layers[0] <= layer < self.layers[1]

    def wants_token(self, position):
        return self.tokens is None or self.tokens[0] <= position < self.tokens[1]


def parse_capture(obj, num_layers, prefix="capture"):
    """The CaptureSpec of a message's capture field (None for null), checked against a model of
    ``num_layers`` layers; errors name ``<prefix>.<field>``."""
    if obj is None:
        return None
    try:
        spec = CaptureSpec.from_json(obj)
        spec.check_layers(num_layers)
        return spec
    except ProtocolError as error:
        raise within(error, prefix) from None


def _pca(value, hooks):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad('pca must be {"hook": name, "layer": index} or null', "pca")
    unknown = sorted(set(value) - set(_PCA_FIELDS))
    if unknown:
        raise _bad(f"unknown pca field {unknown[0]!r}; known: {', '.join(_PCA_FIELDS)}", f"pca.{unknown[0]}")
    point = _captured_site(current_name(value.get("hook")), "pca.hook")
    if point.name not in hooks:
        raise _bad(f"pca.hook {value['hook']!r} must also be among the captured hooks", "pca.hook")
    layer = value.get("layer")
    if point.per_layer:  # null: every captured layer, one pca message each
        layer = None if layer is None else _int(layer, "pca.layer")
    elif layer is not None:
        raise _bad(f"pca.layer must be null for {point.name!r}, which has no layer", "pca.layer")
    return PcaRequest(point.name, layer)
