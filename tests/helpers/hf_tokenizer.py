"""A word-level Hugging Face tokenizer for the converted test models (conversion refuses a folder without one)."""

import json

from tokenizers import Tokenizer, models, pre_tokenizers


def write_word_tokenizer(directory, vocab_size):
    """A tokenizer over w0..w{vocab_size-1}, so that "w5 w17" is exactly the ids [5, 17]."""
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))
