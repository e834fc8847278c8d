"""Pretrain a BERT model: torchrun --nproc_per_node N pretrain_bert.py <Megatron-LM flags>.

Data: tools/preprocess_data.py with --split-sentences and a WordPiece vocabulary, so that each
document holds its sentences (the sentence-order objective needs them).
"""

import megatron.training  # noqa: F401  first: quiets megatron-core's import notices

# isort: split
import functools
import sys

import torch
import torch.nn.functional as F
from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron.training.core_configs import language_model_kwargs, transformer_config
from megatron.training.data import build_datasets, dataset_config_kwargs, next_batch, sum_and_count
from megatron.training.errors import ArgumentError, exit_on_user_error
from megatron.training.local_layer_specs import with_core_attention, with_fp8_gemms
from megatron.training.training import pretrain


class LocalBertModel(BertModel):
    """megatron-core's BertModel with any local core attention.

    BertModel picks its mask layout by asking whether the core attention is its own
    DotProductAttention, and otherwise assumes Transformer Engine (whose version it then reads).
    The local core attentions, ours (SDPAttention) included, take megatron-core's [b, 1, s, s] mask."""

    def _sanity_check_attention_and_get_attn_mask_dimension(self):
        return "b1ss"


def model_provider(args, pre_process=True, post_process=True, vp_stage=None):
    config = transformer_config(args)
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.bert.bert_layer_specs import get_bert_layer_with_transformer_engine_spec

        layer_spec = get_bert_layer_with_transformer_engine_spec()
    else:
        if args.sequence_parallel and bert_layer_local_spec.submodules.input_layernorm is WrappedTorchNorm:
            # BertModel reads its spec as one layer's, so the final norm cannot be swapped in.
            raise ArgumentError("--sequence-parallel with BERT needs apex or --transformer-impl "
                                "transformer_engine; drop --sequence-parallel")
        layer_spec = with_fp8_gemms(with_core_attention(bert_layer_local_spec, args.attention_backend), args)
    model_class = BertModel if args.transformer_impl == "transformer_engine" else LocalBertModel
    return model_class(config=config, transformer_layer_spec=layer_spec,
                     num_tokentypes=2 if args.bert_binary_head else 0, add_binary_head=args.bert_binary_head,
                     **language_model_kwargs(args, pre_process, post_process, vp_stage))


def dataset_provider(args, tokenizer):
    if args.mock_data:
        raise ArgumentError("pretrain_bert.py needs --data-path (a sentence-split WordPiece dataset); "
                            "--mock-data is GPT-only")
    config = BERTMaskedWordPieceDatasetConfig(
        **dataset_config_kwargs(args, tokenizer),
        masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=args.bert_binary_head,
    )
    return build_datasets(args, BERTMaskedWordPieceDataset, config)


def loss_func(loss_mask, sentence_order, output):
    """Masked-LM loss over masked tokens, plus the sentence-order loss with a binary head."""
    lm_losses, sop_logits = output
    mask = loss_mask.float().view(-1)
    lm_losses = lm_losses.float().view(-1)
    lm_loss = torch.sum(lm_losses * mask) / mask.sum().clamp(min=1)
    reported = {"lm loss": sum_and_count(lm_losses, mask)}
    if sop_logits is None:
        return lm_loss, reported
    sop_losses = F.cross_entropy(sop_logits.view(-1, 2).float(), sentence_order.view(-1), reduction="none")
    reported["sop loss"] = sum_and_count(sop_losses, torch.ones_like(sop_losses))
    return lm_loss + sop_losses.mean(), reported


def forward_step(args, data_iterator, model):
    batch = next_batch(args, data_iterator, model, every_stage=True)
    types = batch["types"] if args.bert_binary_head else None
    output = model(batch["text"], batch["padding_mask"], tokentype_ids=types, lm_labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"], batch["is_random"])


@exit_on_user_error
def main():
    pretrain(sys.argv[1:], prog="pretrain_bert.py",
             model_provider=model_provider, dataset_provider=dataset_provider,
             forward_step_func=forward_step)


if __name__ == "__main__":
    main()
