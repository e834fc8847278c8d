"""GPT-2 byte-level BPE from a GPT-2 format vocab.json and merges.txt."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from megatron.training.tokenizer.errors import TokenizerError
from megatron.training.tokenizer.fast_tokenizer import FastTokenizer
from megatron.training.tokenizer.files import parse_json, read_text, token_id

EOD_TOKEN = "<|endoftext|>"
_NEEDED_FOR = "--tokenizer-type GPT2BPETokenizer"


def read_vocab(vocab_file):
    """{token: id} from a GPT-2 vocab.json."""
    vocab = parse_json("--vocab-file", vocab_file, read_text("--vocab-file", vocab_file, _NEEDED_FOR))
    if not isinstance(vocab, dict) or not all(
        isinstance(value, int) and not isinstance(value, bool) for value in vocab.values()
    ):
        raise TokenizerError(
            f"--vocab-file {vocab_file}: expected a JSON object mapping tokens to integer ids "
            f"(a GPT-2 vocab.json)"
        )
    return vocab


def read_merges(merge_file, vocab, vocab_file):
    """[(left, right)] from a GPT-2 merges.txt, in rank order; every token must be in ``vocab``."""
    merges = []
    lines = read_text("--merge-file", merge_file, _NEEDED_FOR).splitlines()
    for line_number, line in enumerate(lines, start=1):
        # Only the first line can be the '#version' header: '# #' later on is a real merge.
        if not line or (line_number == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise TokenizerError(
                f"--merge-file {merge_file}:{line_number}: expected two tokens separated by one space, "
                f"got {line!r}"
            )
        for token in (pair[0], pair[1], pair[0] + pair[1]):
            if token not in vocab:
                raise TokenizerError(
                    f"--merge-file {merge_file}:{line_number}: merge {line!r} needs token {token!r}, "
                    f"which --vocab-file {vocab_file} lacks; pass the vocab.json and merges.txt of "
                    f"the same tokenizer"
                )
        merges.append((pair[0], pair[1]))
    return merges


class GPT2BPETokenizer(FastTokenizer):
    """Byte-level BPE exactly as GPT-2 splits text; ``eod`` is ``<|endoftext|>``.

    ``<|endoftext|>`` written inside a text is ordinary text (encoded byte by byte), as in GPT-2:
    only the end-of-document marker a caller appends is the EOD id.
    """

    def __init__(self, vocab_file, merge_file):
        vocab = read_vocab(vocab_file)
        merges = read_merges(merge_file, vocab, vocab_file)
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        super().__init__(tokenizer, vocab_file, merge_file)
        self._eod = token_id(vocab, EOD_TOKEN, "--vocab-file", vocab_file, _NEEDED_FOR)

    @property
    def eod(self):
        return self._eod
