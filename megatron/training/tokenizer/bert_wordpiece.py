"""BERT WordPiece from a vocab.txt (one token a line, the id is the line number from 0)."""

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from megatron.training.tokenizer.errors import TokenizerError
from megatron.training.tokenizer.fast_tokenizer import FastTokenizer
from megatron.training.tokenizer.files import read_text, token_id

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def read_vocab(vocab_file, needed_for):
    """{token: id} from a BERT vocab.txt."""
    vocab = {}
    for line_number, token in enumerate(read_text("--vocab-file", vocab_file, needed_for).splitlines()):
        if token in vocab:
            raise TokenizerError(
                f"--vocab-file {vocab_file}:{line_number + 1}: token {token!r} already is on line "
                f"{vocab[token] + 1}; every line of a vocab.txt must be a different token"
            )
        vocab[token] = line_number
    return vocab


class BertWordPieceTokenizer(FastTokenizer):
    """BERT's normalization, pre-tokenization and WordPiece; lower_case also strips accents, as
    BERT's uncased models do. ``eod`` is ``[SEP]``, the token that ends a BERT segment."""

    def __init__(self, vocab_file, lower_case):
        needed_for = "--tokenizer-type " + ("BertWordPieceLowerCase" if lower_case else "BertWordPieceCase")
        vocab = read_vocab(vocab_file, needed_for)
        special = {token: token_id(vocab, token, "--vocab-file", vocab_file, needed_for)
                   for token in SPECIAL_TOKENS}
        tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lower_case)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        # No clean-up: it rewrites text (" do not" -> " don't"), not just the spaces around '##'.
        tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
        super().__init__(tokenizer, vocab_file, lower_case=lower_case)
        self._special = special

    # The ids megatron-core's BERT dataset reads.
    cls = property(lambda self: self._special["[CLS]"])
    sep = property(lambda self: self._special["[SEP]"])
    pad = property(lambda self: self._special["[PAD]"])
    mask = property(lambda self: self._special["[MASK]"])
    eod = sep
