"""NullTokenizer: the text already is token ids, written as whitespace-separated integers."""

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

from megatron.training.tokenizer.errors import TokenizerError


class NullTokenizer(MegatronLegacyTokenizer):
    """For pre-tokenized data and benchmarks. As in Megatron-LM, --vocab-size N counts the text
    ids 0..N-1 and the EOD id is N, so ``vocab_size`` is N + 1. A token is its decimal string."""

    def __init__(self, vocab_size):
        if vocab_size is None or vocab_size < 1:
            raise TokenizerError(
                "--vocab-size N (N >= 1) is required for --tokenizer-type NullTokenizer, whose text "
                "is token ids 0..N-1"
            )
        super().__init__(vocab_size=vocab_size)
        self._eod = vocab_size

    def tokenize(self, text):
        ids = []
        for word in text.split():
            if not (word.isascii() and word.isdigit()) or int(word) > self._eod:
                raise TokenizerError(
                    f"NullTokenizer: {word[:20]!r} is not a token id; the text must be integers "
                    f"from 0 to {self._eod} (--vocab-size, the EOD id) separated by whitespace"
                )
            ids.append(int(word))
        return ids

    def detokenize(self, ids):
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self):
        return {str(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self):
        return dict(enumerate(map(str, range(self.vocab_size))))

    @property
    def vocab_size(self):
        return self._eod + 1

    @property
    def eod(self):
        return self._eod
