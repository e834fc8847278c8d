"""The Megatron tokenizer interface over a `tokenizers` (Rust) tokenizer, shared by every
tokenizer type that has a vocabulary file."""

import functools

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer


class FastTokenizer(MegatronLegacyTokenizer):
    """tokenize/detokenize/vocab over ``tokenizer``, a ``tokenizers.Tokenizer`` a subclass builds.

    Subclasses add their special-token ids; ``add_special_tokens`` says whether encoding applies
    the tokenizer's own post-processor (BOS/EOS templates); ``paths`` and ``options`` identify the
    tokenizer to megatron-core's dataset cache.
    """

    def __init__(self, tokenizer, *paths, add_special_tokens=False, **options):
        super().__init__(*paths, **options)
        self._tokenizer = tokenizer
        self._add_special_tokens = add_special_tokens

    def tokenize(self, text):
        return self._tokenizer.encode(text, add_special_tokens=self._add_special_tokens).ids

    def tokenize_plain(self, text):
        """Without the post-processor's BOS/EOS: for text that already has them (a rendered chat template)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids):
        # Special tokens are text too (an EOD stays visible in a decoded document), as in Megatron-LM.
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @functools.cached_property
    def vocab(self):
        # In id order: the library's dict comes in a hash order that changes from process to
        # process, and megatron-core's BERT dataset draws replacement tokens by position in it.
        return dict(sorted(self._tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1]))

    @functools.cached_property
    def inv_vocab(self):
        return {token_id: token for token, token_id in self.vocab.items()}

    @property
    def vocab_size(self):
        return len(self.vocab)
