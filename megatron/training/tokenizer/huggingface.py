"""A Hugging Face fast tokenizer loaded offline from its tokenizer.json (no transformers, no hub)."""

import os

from tokenizers import Tokenizer

from megatron.training.tokenizer.errors import TokenizerError
from megatron.training.tokenizer.fast_tokenizer import FastTokenizer
from megatron.training.tokenizer.files import parse_json, read_text

_NEEDED_FOR = "--tokenizer-type HuggingFaceTokenizer"
# End-of-document tokens of common model families, tried in this order when the folder has no
# tokenizer_config.json naming its eos_token.
_KNOWN_EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


def tokenizer_json_path(tokenizer_model):
    """--tokenizer-model is a tokenizer.json or a folder that holds one."""
    if tokenizer_model is None:
        raise TokenizerError(
            f"--tokenizer-model is required for {_NEEDED_FOR} (a tokenizer.json or its folder)")
    if not os.path.isdir(tokenizer_model):
        return tokenizer_model
    path = os.path.join(tokenizer_model, "tokenizer.json")
    if not os.path.isfile(path):
        raise TokenizerError(
            f"--tokenizer-model {tokenizer_model}: the folder has no tokenizer.json; only the fast "
            f"tokenizer.json format can be loaded offline"
        )
    return path


def configured_eos_token(folder):
    """The eos_token that a tokenizer_config.json beside tokenizer.json names, or None."""
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    config = parse_json("--tokenizer-model", path, read_text("--tokenizer-model", path, _NEEDED_FOR))
    eos_token = config.get("eos_token") if isinstance(config, dict) else None
    # transformers writes either the token text or an AddedToken object with its text in "content".
    return eos_token.get("content") if isinstance(eos_token, dict) else eos_token


class HuggingFaceTokenizer(FastTokenizer):
    """Encodes with the tokenizer's own post-processor (its BOS/EOS template), as Megatron-LM's
    HuggingFaceTokenizer does through transformers. ``eod`` is the eos_token of the
    tokenizer_config.json beside tokenizer.json, else the first known end token in the vocabulary."""

    def __init__(self, tokenizer_model):
        path = tokenizer_json_path(tokenizer_model)
        text = read_text("--tokenizer-model", path, _NEEDED_FOR)
        try:
            tokenizer = Tokenizer.from_str(text)
        except Exception as error:  # tokenizers raises a bare Exception for every malformed file
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise TokenizerError(
                f"--tokenizer-model {path}: not a valid tokenizer.json ({message})") from None
        super().__init__(tokenizer, path, add_special_tokens=True)
        self._path = path
        eos_token = configured_eos_token(os.path.dirname(path))
        candidates = (eos_token,) if eos_token is not None else _KNOWN_EOD_TOKENS
        self._eod = next((self.vocab[token] for token in candidates if token in self.vocab), None)
        self._eod_candidates = candidates

    @property
    def eod(self):
        if self._eod is None:
            raise TokenizerError(
                f"--tokenizer-model {self._path}: no end-of-document token (looked for "
                f"{', '.join(self._eod_candidates)}); name one as eos_token in a tokenizer_config.json "
                f"beside it"
            )
        return self._eod
