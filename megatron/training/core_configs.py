"""Translate validated flags into megatron-core's configuration objects."""

import importlib.util

import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend


def transformer_config(args):
    on_cpu = args.device == "cpu"
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        sequence_parallel=args.sequence_parallel,
        use_cpu_initialization=args.use_cpu_initialization,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        attention_backend=attention_backend_of(args),
        # The fusions are torch.compile'd functions that pay off on GPU only. GeLU's needs a bias to
        # fuse with; SwiGLU's does not. The masked softmax fusion (unfused attention only) needs apex's
        # kernel, which megatron-core imports without a fallback.
        bias_activation_fusion=not on_cpu and (args.bias_swiglu_fusion if args.swiglu
                                               else args.bias_gelu_fusion and args.add_bias_linear),
        bias_dropout_fusion=not on_cpu and args.bias_dropout_fusion,
        cross_entropy_loss_fusion=not on_cpu and args.cross_entropy_loss_fusion,  # megatron-core's native one
        masked_softmax_fusion=(not on_cpu and args.masked_softmax_fusion
                               and importlib.util.find_spec("scaled_masked_softmax_cuda") is not None),
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        # Frees a sent activation's storage early (its autograd graph stays); a CUDA-graphed layer's output is a
        # view of the graph's static buffer, which megatron-core refuses to free ("counter-productive to free a
        # view of another tensor", the first pipelined iteration with --cuda-graph-impl local).
        deallocate_pipeline_outputs=args.cuda_graph_impl == "none",
        cuda_graph_impl=args.cuda_graph_impl,
        cuda_graph_scope=args.cuda_graph_scope,  # empty: the whole layer
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        # On GPUs the interleaved schedule overlaps its pipeline transfers with compute, one isend/irecv per
        # direction (Megatron-LM's default). Batched, a ring of two stages sends both directions to one peer over
        # one communicator, which matches them in order: the activation lands in the gradient's buffer (Inf
        # gradients at the first step). Other pipelines batch them on NCCL. On CPU every transfer completes before
        # the schedule goes on: gloo reads a send's tensor on its own thread, after the schedule has freed it.
        overlap_p2p_comm=interleaved and not on_cpu,
        batch_p2p_comm=not on_cpu and not interleaved,
        # megatron-core synchronizes the whole device after every batched transfer, a workaround for an old
        # PyTorch: a host-bound stage then pays its host and its GPU time one after the other. The schedule's
        # stream waits on the transfers already order them. A whole-iteration graph cannot capture the sync.
        batch_p2p_sync=args.batch_p2p_sync and not whole_iteration_graph(args),
        **transformer_engine_fp8(args),
    )


def transformer_engine_fp8(args):
    """Megatron-LM's FP8 settings, for Transformer Engine's layers only: megatron-core reads ``fp8`` as "enter
    Transformer Engine's FP8 autocast". The local layers' FP8 is their layer spec's (``fp8_linears.py``)."""
    if args.transformer_impl != "transformer_engine" or args.fp8 is None:
        return {}
    return {"fp8": args.fp8, "fp8_recipe": args.fp8_recipe}


def whole_iteration_graph(args):
    """--cuda-graph-scope full_iteration: one graph replays the iteration's whole forward-backward schedule."""
    return "full_iteration" in args.cuda_graph_scope


def attention_backend_of(args):
    """megatron-core's attention backend setting. With the local implementation our layer spec picks
    the core attention (``local_layer_specs.local_core_attention``) and Transformer Engine is not
    involved: ``local`` tells megatron-core so (it switches TE's attention environment off)."""
    if args.transformer_impl == "local":
        return AttnBackend.local
    return AttnBackend[args.attention_backend]


def ddp_config(args):
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # With a dynamic fp16 loss scale an overflow (inf/NaN grads) is expected while the scale
        # settles: the optimizer skips that step, so stopping the run on it would be wrong.
        # A whole-iteration graph cannot read the gradients' norm on the host in the middle of its iteration.
        check_for_nan_in_grad=not (args.fp16 and args.loss_scale is None) and not whole_iteration_graph(args),
    )


def optimizer_config(args):
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=args.params_dtype,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
    )


def language_model_kwargs(args, pre_process, post_process, vp_stage):
    """Constructor arguments that megatron-core's GPTModel and BertModel share."""
    return dict(
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        vp_stage=vp_stage,
    )
