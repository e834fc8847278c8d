"""Reductions a client may ask for: a small declarative set, parsed and validated, never evaluated.

Each reduces the LAST dim of a captured tensor [tokens, ..., last]:
    none          the raw values
    norm          L2 norm over the last dim (the dim disappears)
    mean_heads    mean over the "head" dim (hooks with heads only: attn.q/k/v/pattern)
    bins(n)       mean-pooling of the last dim into n equal bins (1 <= n <= 4096)
    slice(a,b)    the values a .. b-1 of the last dim (0 <= a < b)
    topk_abs(k)   the k values of largest magnitude: last dim becomes [k, 2] = (index, value) (1 <= k <= 4096)
"""

import re
from dataclasses import dataclass

import torch

from megascope.errors import ProtocolError

REDUCTION_FORMS = ("none", "norm", "mean_heads", "bins(n)", "slice(a,b)", "topk_abs(k)")
_LIMITS = {"bins": 4096, "topk_abs": 4096}
_CALL = re.compile(r"^(bins|slice|topk_abs)\((\d{1,7})(?:,(\d{1,7}))?\)$")


@dataclass(frozen=True)
class Reduction:
    kind: str
    args: tuple = ()

    def __str__(self):
        return self.kind if not self.args else f"{self.kind}({','.join(map(str, self.args))})"

    @classmethod
    def parse(cls, text, field="reduction"):
        if not isinstance(text, str):
            raise ProtocolError("bad_reduction", f"a reduction is a string, one of {', '.join(REDUCTION_FORMS)}", field)
        compact = text.replace(" ", "")
        if compact in ("none", "norm", "mean_heads"):
            return cls(compact)
        match = _CALL.match(compact)
        if match is None:
            raise ProtocolError("bad_reduction", f"unknown reduction {text!r}; use one of {', '.join(REDUCTION_FORMS)}",
                                field)
        kind, first, second = match.group(1), int(match.group(2)), match.group(3)
        if kind == "slice":
            if second is None or not first < int(second):
                raise ProtocolError("bad_reduction", f"{text!r}: slice(a,b) needs two integers with a < b", field)
            return cls(kind, (first, int(second)))
        if second is not None or not 1 <= first <= _LIMITS[kind]:
            raise ProtocolError("bad_reduction", f"{text!r}: {kind} takes one integer from 1 to {_LIMITS[kind]}", field)
        return cls(kind, (first,))

    def check_applies_to(self, dims, hook, field):
        if self.kind == "mean_heads" and "head" not in dims:
            raise ProtocolError("bad_reduction", f"mean_heads needs a hook with heads; {hook!r} has none", field)

    def dims_after(self, dims):
        """The dims after the token dim of what ``apply`` returns for values of ``dims``."""
        dims = list(dims)
        if self.kind in ("none", "slice"):
            return dims
        if self.kind == "norm":
            return dims[:-1]
        if self.kind == "mean_heads":
            return [dim for dim in dims if dim != "head"]
        if self.kind == "bins":
            return dims[:-1] + [f"{dims[-1]}_bin"]
        return dims[:-1] + ["topk", "index_value"]

    def apply(self, values, dims):
        """values [tokens, *dims] (float32, on any device) -> (reduced values [tokens, ...], their dims after the
        token dim)."""
        reduced_dims = self.dims_after(dims)
        if self.kind == "none":
            return values, reduced_dims
        if self.kind == "norm":
            return values.norm(dim=-1), reduced_dims
        if self.kind == "mean_heads":
            return values.mean(dim=list(dims).index("head") + 1), reduced_dims  # values have the token dim first
        if self.kind == "slice":
            start, end = self.args
            return values[..., start:end], reduced_dims
        if self.kind == "bins":
            n = min(self.args[0], values.size(-1))
            pooled = torch.nn.functional.adaptive_avg_pool1d(values.reshape(-1, 1, values.size(-1)), n)
            return pooled.reshape(*values.shape[:-1], n), reduced_dims
        k = min(self.args[0], values.size(-1))
        indices = values.abs().topk(k, dim=-1).indices
        pairs = torch.stack([indices.float(), values.gather(-1, indices)], dim=-1)
        return pairs, reduced_dims
