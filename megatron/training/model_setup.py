"""Build the model chunks of this rank, wrap them in megatron-core DDP, and build the optimizer."""

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from megatron.training.compiled_layers import compile_transformer_layers
from megatron.training.core_configs import ddp_config, optimizer_config
from megatron.training.layout_invariant_init import reinitialize_layout_invariant


def _build_chunks(args, model_provider):
    """One model chunk per virtual pipeline stage (a single chunk without virtual pipelining)."""
    vp_size = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp_size or 1):
        stage = None if vp_size is None else vp_stage
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        chunks.append(model_provider(pre_process=pre, post_process=post, vp_stage=stage))
    return chunks


def build_model(args, model_provider, with_gradients=True):
    """Model chunks of this rank, on the training device, wrapped in megatron-core DDP; without
    ``with_gradients`` the bare chunks (bf16/fp16 still cast at their boundary), which hold no
    gradient buffers (MegaFBD's forward instances)."""
    chunks = _build_chunks(args, model_provider)
    config = get_model_config(chunks[0])
    if args.use_cpu_initialization:
        reinitialize_layout_invariant(chunks, config, args.seed)
    if args.device == "cuda":
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    if args.fp16 or args.bf16:
        # Casts the weights and the inputs/outputs at the chunk's boundary, as in Megatron-LM.
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    if not with_gradients:
        return chunks
    return [
        DistributedDataParallel(config, ddp_config(args), chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]


def build_scheduler(args, optimizer):
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=args.lr_wsd_decay_iters,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def connect_schedule_hooks(args, model, optimizer):
    """Tell megatron-core's pipeline schedules how to sync grads and scale the loss (as Megatron-LM)."""
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        grad_sync = [chunk.start_grad_sync for chunk in model]
        config.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    if args.overlap_param_gather:
        param_sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = param_sync[0] if len(model) == 1 else param_sync


def use_fused_adam(optimizer):
    """Switch megatron-core's PyTorch Adam fallback to PyTorch's fused (one kernel per step) update.

    Without apex or Transformer Engine megatron-core builds ``torch.optim.Adam(W)`` with PyTorch's
    default multi-tensor ``foreach`` update, several launches per parameter group and step. Called after
    a checkpoint load, which restores the saved param groups' flags, and moves restored ``step``
    counters to the device as the fused update requires."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
            for param in group["params"]:
                state = torch_optimizer.state.get(param, {})
                if "step" in state:
                    state["step"] = state["step"].to(device=param.device, dtype=torch.float32)


def setup_model_and_optimizer(args, model_provider):
    model = build_model(args, model_provider)
    if args.compile_transformer_layers:
        compile_transformer_layers(model)
    optimizer = get_megatron_optimizer(optimizer_config(args), model)
    scheduler = build_scheduler(args, optimizer)
    connect_schedule_hooks(args, model, optimizer)
    return model, optimizer, scheduler
