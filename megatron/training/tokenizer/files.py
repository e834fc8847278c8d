"""Reading the files a tokenizer is built from, with one-line errors that name the flag."""

import json

from megatron.training.tokenizer.errors import TokenizerError


def read_text(flag, path, needed_for):
    """The UTF-8 text of the file passed with ``flag``; ``needed_for`` completes 'is required for'."""
    if path is None:
        raise TokenizerError(f"{flag} is required for {needed_for}")
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except FileNotFoundError:
        raise TokenizerError(f"{flag} {path}: no such file; pass the file {needed_for} needs") from None
    except UnicodeDecodeError as error:
        raise TokenizerError(
            f"{flag} {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise TokenizerError(f"{flag} {path}: cannot read it ({error.strerror})") from None


def parse_json(flag, path, text):
    """The JSON value in ``text`` (read from ``path``); a syntax error names the line and column."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        reason = error.msg.removesuffix(" at")  # some messages end in "at", before the position
        raise TokenizerError(
            f"{flag} {path}: not valid JSON ({reason} at line {error.lineno} column {error.colno})") from None


def token_id(vocab, token, flag, path, needed_for):
    """The id of a special ``token`` that the vocabulary in ``path`` must contain."""
    if token not in vocab:
        raise TokenizerError(f"{flag} {path}: has no {token!r} token, which {needed_for} needs")
    return vocab[token]
