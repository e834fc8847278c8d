#!/usr/bin/env python
"""Build the sample data shipped in datasets/, from text already on every Python install.

The corpus is the Python Language Reference as the standard library carries it for ``help()``
(``pydoc_data.topics``, PSF License), one document per section. From it this script trains a
GPT-2-format byte-level BPE (datasets/gpt/vocab.json + merges.txt) and a lowercase BERT WordPiece
vocabulary (datasets/bert/vocab.txt), both of exactly VOCAB_SIZE entries. Nothing is downloaded.
Run from anywhere:  python tools/make_sample_data.py [--output-dir datasets]
The output is the same, byte for byte, for the same Python and `tokenizers` versions.
"""

import argparse
import json
import os
import re
import sys
from pydoc_data.topics import topics

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from megatron.training.atomic_file import replaced_on_success

# 8192 = 64 * 128: a multiple of --make-vocab-size-divisible-by 128 times a tensor-parallel size of
# 1, 2, 4 (or 8, 16, 32, 64), so the model's embedding needs no padding rows for those sizes.
VOCAB_SIZE = 8192
GPT2_EOD_TOKEN = "<|endoftext|>"
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_CONTINUATION_PLANE = 0xF0000  # Unicode plane 15, private use
DEFAULT_OUTPUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "datasets")

# A section starts at a title line underlined with '*', '=' or '-' (reStructuredText headings).
_SECTION_START = re.compile(r"(?m)^(?=[^\n]+\n[*=\-]{3,}\n)")


def corpus_documents():
    """[{"id", "text"}]: every section of every help() topic, topics in name order, each text once."""
    documents, seen = [], set()
    for topic in sorted(topics):
        for index, section in enumerate(_SECTION_START.split(topics[topic])):
            text = section.strip()
            if text and text not in seen:
                seen.add(text)
                documents.append({"id": f"{topic}/{index}", "text": text})
    return documents


def train_gpt2_bpe(texts):
    """(vocab, merges) of a byte-level BPE in GPT-2's layout: the trained tokens, then EOD last."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so any text encodes
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
    vocab[GPT2_EOD_TOKEN] = len(vocab)
    # The serialized merges are [left, right] pairs (older `tokenizers` wrote "left right").
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]]
    return vocab, merges


def train_bert_wordpiece(texts):
    """The tokens of a lowercase BERT WordPiece vocabulary, in id order: the special tokens, the
    trained tokens, then "[unusedN]" placeholders up to VOCAB_SIZE, as BERT's own vocab.txt has.

    WordPiece training is BPE over BERT's words in which every piece but a word's first is a
    "##" continuation (what tokenizers' WordPieceTrainer does). That trainer numbers the "##"
    pieces in hash-map order, so its result changes run to run; here the continuation characters
    are instead shifted into a private-use plane, making every piece a sequence of characters of
    one sorted alphabet, and the BPE trainer deterministic. Training stops once every word of the
    corpus is one token (about 5,600 here); the placeholders fill the rest and never occur in text.
    """
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words = [
        [word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))]
        for text in texts
    ]
    characters = sorted({character for text_words in words for word in text_words for character in word})
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=BERT_SPECIAL_TOKENS,
        # Every character both starts and continues a word, so any word of the alphabet encodes.
        initial_alphabet=characters + [_continuation(character) for character in characters],
        show_progress=False,
    )
    marked_texts = (
        " ".join(word[0] + "".join(map(_continuation, word[1:])) for word in text_words)
        for text_words in words
    )
    tokenizer.train_from_iterator(marked_texts, trainer=trainer)
    trained = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    tokens = [_wordpiece(token) for token, _ in trained]
    return tokens + [f"[unused{index}]" for index in range(VOCAB_SIZE - len(tokens))]


def _continuation(character):
    """The private-use stand-in for ``character`` after the first of a word (text is in the BMP)."""
    return chr(_CONTINUATION_PLANE + ord(character))


def _wordpiece(token):
    """A trained token in WordPiece spelling: stand-ins back to characters, "##" if it continues."""
    if token in BERT_SPECIAL_TOKENS:
        return token
    text = "".join(chr(ord(c) - _CONTINUATION_PLANE) if ord(c) >= _CONTINUATION_PLANE else c for c in token)
    return "##" + text if ord(token[0]) >= _CONTINUATION_PLANE else text


def write_atomically(path, text):
    """Write ``text`` to ``path`` through a temporary file renamed into place: never half-written."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with replaced_on_success(path) as temporary, open(temporary, "w", encoding="utf-8", newline="\n") as file:
        file.write(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help="default: the repository's datasets/")
    output_dir = parser.parse_args(argv).output_dir

    documents = corpus_documents()
    texts = [document["text"] for document in documents]
    corpus = "".join(json.dumps(document, ensure_ascii=False) + "\n" for document in documents)

    gpt2_vocab, gpt2_merges = train_gpt2_bpe(texts)
    bert_vocab = train_bert_wordpiece(texts)
    for name, size in (("GPT-2 BPE", len(gpt2_vocab)), ("BERT WordPiece", len(bert_vocab))):
        if size != VOCAB_SIZE:
            sys.exit(f"make_sample_data.py: error: the {name} vocabulary has {size} entries, not "
                     f"{VOCAB_SIZE}: this corpus cannot fill it; nothing was written")

    outputs = {
        os.path.join("gpt", "corpus.jsonl"): corpus,
        os.path.join("bert", "corpus.jsonl"): corpus,
        os.path.join("gpt", "vocab.json"): json.dumps(gpt2_vocab, ensure_ascii=False, indent=0) + "\n",
        os.path.join("gpt", "merges.txt"): "#version: 0.2\n" + "".join(merge + "\n" for merge in gpt2_merges),
        os.path.join("bert", "vocab.txt"): "".join(token + "\n" for token in bert_vocab),
    }
    for relative_path, text in outputs.items():
        write_atomically(os.path.join(output_dir, relative_path), text)
    print(f"Wrote {len(documents)} documents ({len(corpus.encode())} bytes) and {VOCAB_SIZE}-entry "
          f"vocabularies under {os.path.normpath(output_dir)}")


if __name__ == "__main__":
    main()
