"""Model FLOPs of one training iteration of a dense GPT/BERT transformer, for TFLOP/s reporting.

Counted from the matrix products (2 FLOPs per multiply-add): per token and layer the QKV,
attention-output and MLP projections, the full (unmasked) score and value products, and the
logits once per token. Backward costs twice the forward; full activation recomputation adds
one more forward of the layers. This is the convention of Megatron-LM's throughput figures.
"""


def layer_matrix_weights(args) -> int:
    """Weights of one transformer layer's matrices (biases and norms left out): each is one multiply-add
    per token, and they are nearly all of a layer's parameters."""
    h = args.hidden_size
    query_width = args.num_attention_heads * args.kv_channels
    kv_width = args.num_query_groups * args.kv_channels
    mlp_inputs = 2 if args.swiglu else 1
    return (h * (query_width + 2 * kv_width)  # QKV projection
            + query_width * h  # attention output projection
            + h * args.ffn_hidden_size * mlp_inputs + args.ffn_hidden_size * h)  # MLP


def training_flops_per_iteration(args, padded_vocab_size):
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    query_width = args.num_attention_heads * args.kv_channels
    macs_per_token_layer = layer_matrix_weights(args) + 2 * s * query_width  # + scores (Q K^T), weighted values
    layer_forward = 2 * macs_per_token_layer * layers
    logits_forward = 2 * h * padded_vocab_size
    layer_passes = 3 + (1 if args.recompute_granularity == "full" else 0)
    tokens = args.global_batch_size * s
    return tokens * (layer_passes * layer_forward + 3 * logits_forward)
