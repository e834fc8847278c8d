"""Tokenizers for Megatron-LM's --tokenizer-type names, on the `tokenizers` library, offline.

Every one subclasses megatron-core's ``MegatronLegacyTokenizer`` (what its GPT and BERT datasets
read: ``eod``, ``vocab_size``, ``cls``/``sep``/``mask``/``pad``, ``inv_vocab``), and every load
failure is a ``TokenizerError`` with a one-line message.
"""

from megatron.training.tokenizer.bert_wordpiece import BertWordPieceTokenizer
from megatron.training.tokenizer.build import TOKENIZER_TYPES, build_tokenizer, vocab_size_with_padding
from megatron.training.tokenizer.errors import TokenizerError
from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.training.tokenizer.huggingface import HuggingFaceTokenizer
from megatron.training.tokenizer.null import NullTokenizer

__all__ = [
    "TOKENIZER_TYPES",
    "BertWordPieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "TokenizerError",
    "build_tokenizer",
    "vocab_size_with_padding",
]
