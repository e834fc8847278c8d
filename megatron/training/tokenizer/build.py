"""--tokenizer-type -> tokenizer, and the vocabulary padding the model's embedding uses."""

from megatron.training.tokenizer.bert_wordpiece import BertWordPieceTokenizer
from megatron.training.tokenizer.errors import TokenizerError
from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.training.tokenizer.huggingface import HuggingFaceTokenizer
from megatron.training.tokenizer.null import NullTokenizer

# Each builder reads only the flags its type needs; a missing flag reads as None.
_BUILDERS = {
    "GPT2BPETokenizer": lambda flag: GPT2BPETokenizer(flag("vocab_file"), flag("merge_file")),
    "BertWordPieceLowerCase": lambda flag: BertWordPieceTokenizer(flag("vocab_file"), lower_case=True),
    "BertWordPieceCase": lambda flag: BertWordPieceTokenizer(flag("vocab_file"), lower_case=False),
    "HuggingFaceTokenizer": lambda flag: HuggingFaceTokenizer(flag("tokenizer_model")),
    "NullTokenizer": lambda flag: NullTokenizer(flag("vocab_size")),
}
TOKENIZER_TYPES = tuple(_BUILDERS)


def vocab_size_with_padding(orig_vocab_size, make_vocab_size_divisible_by, tensor_model_parallel_size):
    """The vocabulary size rounded up so every tensor-parallel shard of the embedding has the
    same size, a multiple of --make-vocab-size-divisible-by (the extra rows are never a target)."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


def build_tokenizer(args):
    """The tokenizer that args.tokenizer_type names, built from Megatron-LM's flags.

    Like Megatron-LM it also sets ``args.padded_vocab_size`` unless already set (e.g. by a
    checkpoint), from --make-vocab-size-divisible-by (default 128) and --tensor-model-parallel-size.
    """
    tokenizer_type = getattr(args, "tokenizer_type", None)
    if tokenizer_type not in _BUILDERS:
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type} is not supported; use one of {', '.join(TOKENIZER_TYPES)}"
        )
    tokenizer = _BUILDERS[tokenizer_type](lambda name: getattr(args, name, None))
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = vocab_size_with_padding(
            tokenizer.vocab_size,
            getattr(args, "make_vocab_size_divisible_by", 128),
            getattr(args, "tensor_model_parallel_size", 1),
        )
    return tokenizer
