"""What a welcome message tells a client about the model and the library (both sessions send it)."""

from megascope.hook_sites import DEPRECATED, PERTURBATION_TARGETS, captured_full_names
from megascope.perturbations import NOISE_TYPES
from megascope.reductions import REDUCTION_FORMS

# What a generation runs on megatron-core's eager inference path for, rather than on the static cache where the
# capture is compiled into each (CUDA-graphed) step, and why (megascope/inference_session.py).
EAGER_FEATURES = {
    "patch": "a patch writes the positions of each step, which a graph cannot follow",
    "attribution": "attribution reads the token each step chose, after the step",
    "calculation": "calculation noise draws new noise in every forward, which a graph would replay",
}


def welcome_info(args, vocab_size):
    """The welcome's model shape and parallel layout, and the hooks, reductions, noise kinds and perturbation
    targets (per kind) served: a client offers what is declared here, so that it offers nothing refused.
    ``vocab_size``: the tokenizer's (the output layer's padding rows are no tokens)."""
    return {"model": {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                      "num_attention_heads": args.num_attention_heads,
                      "num_query_groups": args.num_query_groups or args.num_attention_heads,
                      "vocab_size": vocab_size, "tp": args.tensor_model_parallel_size,
                      "pp": args.pipeline_model_parallel_size, "dp": args.data_parallel_size},
            "hooks": captured_full_names(), "reductions": list(REDUCTION_FORMS), "noise": list(NOISE_TYPES),
            "perturbation_targets": {kind: list(targets) for kind, targets in PERTURBATION_TARGETS.items()},
            "eager": EAGER_FEATURES, "deprecated": DEPRECATED}

