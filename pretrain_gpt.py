"""Pretrain a GPT model: torchrun --nproc_per_node N pretrain_gpt.py <Megatron-LM flags>."""

import megatron.training  # noqa: F401  first: quiets megatron-core's import notices

# isort: split
import functools
import sys

import torch
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)

from megatron.training.core_configs import language_model_kwargs, transformer_config
from megatron.training.data import build_datasets, dataset_config_kwargs, next_batch, sum_and_count
from megatron.training.errors import exit_on_user_error
from megatron.training.local_layer_specs import block_spec_with_torch_norms, with_core_attention, with_fp8_gemms
from megatron.training.tp_comm_overlap import with_tp_comm_overlap
from megatron.training.training import pretrain


def model_provider(args, pre_process=True, post_process=True, vp_stage=None):
    config = transformer_config(args)
    if args.transformer_impl == "transformer_engine":
        layer_spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = with_core_attention(get_gpt_layer_local_spec(normalization=args.normalization),
                                         args.attention_backend)
        layer_spec = with_fp8_gemms(layer_spec, args)
        if args.tp_comm_overlap:
            layer_spec = with_tp_comm_overlap(layer_spec)
        layer_spec = block_spec_with_torch_norms(layer_spec, config, vp_stage)
    return GPTModel(config=config, transformer_layer_spec=layer_spec, rotary_base=args.rotary_base,
                    rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
                    **language_model_kwargs(args, pre_process, post_process, vp_stage))


def dataset_provider(args, tokenizer):
    config = GPTDatasetConfig(
        **dataset_config_kwargs(args, tokenizer),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,  # causal masking happens inside attention
    )
    return build_datasets(args, MockGPTDataset if args.mock_data else GPTDataset, config)


def loss_func(loss_mask, output_tensor):
    """Mean loss over unmasked tokens; reports (sum, count) so replicas average exactly."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    return torch.sum(losses * mask) / mask.sum().clamp(min=1), {"lm loss": sum_and_count(losses, mask)}


def forward_step(args, data_iterator, model):
    batch = next_batch(args, data_iterator, model)
    if batch is None:  # a middle pipeline stage
        return model(None, None, None), None
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


@exit_on_user_error
def main():
    pretrain(sys.argv[1:], prog="pretrain_gpt.py",
             model_provider=model_provider, dataset_provider=dataset_provider,
             forward_step_func=forward_step)


if __name__ == "__main__":
    main()
