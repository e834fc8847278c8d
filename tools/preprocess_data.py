#!/usr/bin/env python
"""Tokenize a JSON-lines corpus into megatron-core IndexedDataset files for --data-path.

Every non-blank line of --input is one JSON object, one document. For each --json-keys KEY the
tool writes <output-prefix>_<KEY>_document.bin/.idx (_sentence with --split-sentences, whose
sentences are separate sequences of one document), with Megatron-LM's flags and file names.
The files appear only when complete: they are written under temporary names beside them.
"""

import contextlib
import json
import multiprocessing
import os
import re
import sys
import time

import numpy

# Only light modules here: megatron-core (under megatron.training.tokenizer too) takes seconds to
# import, so preprocess() imports it after the checks of the flags, the input and the output folder.
from megatron.training.arguments import MegatronArgumentParser
from megatron.training.atomic_file import replaced_on_success
from megatron.training.errors import UserError

PROG = "preprocess_data.py"

# A sentence ends at '.', '!' or '?' (and any closing quotes or brackets after it) when whitespace
# and then a capital letter, a digit or an opening quote or bracket follow, or at the last
# character before a blank line. The whitespace after the end goes with the next sentence, so the
# sentences of a text join back into it exactly. No language model: "e.g. Foo" splits after "e.g.".
_SENTENCE_END = re.compile(r"""[.!?]['")\]]*(?=\s+['"(\[]?[A-Z0-9])|\S(?=[^\S\n]*\n[^\S\n]*\n)""")


class InputError(UserError):
    """Bad input or output location: reported as one line naming the file, never a traceback."""


def split_sentences(text):
    """The sentences of ``text``, in order; together they are ``text``."""
    ends = [match.end() for match in _SENTENCE_END.finditer(text)]
    return [text[start:end] for start, end in zip([0] + ends, ends + [len(text)]) if start < end]


def parse_args(argv=None):
    parser = MegatronArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    group = parser.add_argument_group("input")
    group.add_argument("--input", required=True, help="JSON-lines file, one document a line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys of the texts to tokenize")
    group.add_argument("--split-sentences", action="store_true",
                       help="store each sentence as its own sequence (regex splitter, see source)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True,
                       help="a Megatron-LM tokenizer type, e.g. GPT2BPETokenizer (a wrong one lists them)")
    group.add_argument("--vocab-file", help="GPT-2 vocab.json or BERT vocab.txt")
    group.add_argument("--merge-file", help="GPT-2 merges.txt")
    group.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: tokenizer.json or its folder")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer: ids 0..N-1 in the text, EOD is N")
    group.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="path prefix of the .bin/.idx files")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.log_interval < 1:
        parser.error("--workers and --log-interval must be at least 1")
    return args


class DocumentEncoder:
    """One input line -> for each key, the document's token ids and its sentence lengths."""

    def __init__(self, tokenizer, args, dtype):
        self.tokenizer = tokenizer
        self.keys = args.json_keys
        self.split_sentences = args.split_sentences
        self.eod = tokenizer.eod if args.append_eod else None
        self.dtype = dtype
        self.input_name = args.input

    def __call__(self, numbered_line):
        line_number, line = numbered_line
        document = self._parse(line_number, line)
        encoded = []
        for key in self.keys:
            try:
                texts = split_sentences(document[key]) if self.split_sentences else [document[key]]
                sentences = [ids for ids in map(self.tokenizer.tokenize, texts) if ids]
            except UserError as error:  # a TokenizerError: e.g. NullTokenizer text that is not ids
                raise InputError(f"{self.input_name}:{line_number}: key {key!r}: {error}") from None
            if sentences and self.eod is not None:
                sentences[-1] = list(sentences[-1]) + [self.eod]
            ids = [token_id for sentence in sentences for token_id in sentence]
            encoded.append((numpy.array(ids, dtype=self.dtype), [len(sentence) for sentence in sentences]))
        return encoded, len(line)

    def _parse(self, line_number, line):
        where = f"{self.input_name}:{line_number}"
        try:
            document = json.loads(line)
        except UnicodeDecodeError as error:
            raise InputError(f"{where}: not UTF-8 ({error.reason} at byte {error.start}); "
                             f"save the file as UTF-8") from None
        except json.JSONDecodeError as error:
            reason = error.msg.removesuffix(" at")  # some messages end in "at", before the position
            raise InputError(f"{where}: not valid JSON ({reason} at column {error.colno}); "
                             f"each line must be one JSON object") from None
        if not isinstance(document, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(document).__name__}")
        for key in self.keys:
            if key not in document:
                raise InputError(f"{where}: no key {key!r}; every line needs each --json-keys key "
                                 f"(this one has {', '.join(map(repr, document)) or 'none'})")
            if not isinstance(document[key], str):
                raise InputError(f"{where}: key {key!r} is {type(document[key]).__name__}, not a string")
        return document


# Each worker process gets the encoder once, through the pool initializer, not once per task.
_worker_encoder = None


def _init_worker(encoder):
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(numbered_line):
    return _worker_encoder(numbered_line)


def numbered_lines(file):
    """(line number from 1, bytes) of every non-blank line."""
    return ((number, line) for number, line in enumerate(file, start=1) if line.strip())


class ProgressLog:
    """'Processed N documents (X docs/s, Y MB/s).' every ``interval`` documents and at the end."""

    def __init__(self, interval):
        self.interval = interval
        self.start = time.monotonic()
        self.documents = 0
        self.bytes = 0

    def add(self, line_bytes):
        self.documents += 1
        self.bytes += line_bytes
        if self.documents % self.interval == 0:
            self.report()

    def report(self):
        elapsed = max(time.monotonic() - self.start, 1e-9)
        print(f"Processed {self.documents} documents ({self.documents / elapsed:.1f} docs/s, "
              f"{self.bytes / elapsed / 1e6:.2f} MB/s).", file=sys.stderr, flush=True)


def output_prefix(args, key):
    return f"{args.output_prefix}_{key}_{'sentence' if args.split_sentences else 'document'}"


def encoded_documents(encoder, lines, workers):
    """The encoder's results for ``lines`` in input order, from ``workers`` processes."""
    if workers == 1:
        yield from map(encoder, lines)
        return
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(encoder,)) as pool:
        yield from pool.imap(_encode_in_worker, lines, chunksize=32)


def preprocess(args, input_file):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron.training.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(args)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    encoder = DocumentEncoder(tokenizer, args, dtype)
    make_output_directory(args.output_prefix)  # only now: a failed flag check above leaves no directory
    prefixes = [output_prefix(args, key) for key in args.json_keys]
    # Every .bin/.idx is written under a temporary name beside it; all are renamed into place when every one
    # is complete (the exit of ``published``), and removed, with nothing else, when anything fails.
    with contextlib.ExitStack() as published:
        try:
            temporaries = [{suffix: published.enter_context(replaced_on_success(prefix + suffix))
                            for suffix in (".bin", ".idx")} for prefix in prefixes]
        except OSError as error:  # the temporary file's hidden name would mean nothing to the user
            raise InputError(f"--output-prefix {args.output_prefix}: cannot write in "
                             f"{os.path.dirname(args.output_prefix) or '.'} ({error.strerror}); "
                             f"choose a writable location") from None
        builders = []
        for paths in temporaries:
            builders.append(IndexedDatasetBuilder(paths[".bin"], dtype=dtype))
            # closed before its temporary is renamed or removed (finalize has closed it on success)
            published.callback(builders[-1].data_file.close)
        progress = ProgressLog(args.log_interval)
        for encoded, line_bytes in encoded_documents(encoder, numbered_lines(input_file), args.workers):
            for builder, (ids, lengths) in zip(builders, encoded):
                builder.add_document(ids, lengths)
            progress.add(line_bytes)
        progress.report()
        for builder, paths in zip(builders, temporaries):
            builder.finalize(paths[".idx"])
    for prefix in prefixes:
        print(f"Wrote {prefix}.bin and {prefix}.idx")


def open_input(path):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise InputError(
            f"--input {path}: no such file; pass a JSON-lines file, one document a line") from None
    except OSError as error:
        raise InputError(f"--input {path}: cannot read it ({error.strerror})") from None


def check_output_directory(prefix):
    """Fails early, creating nothing, when the output directory cannot be made: a file is in its way."""
    directory = os.path.dirname(os.path.abspath(prefix))
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError(f"--output-prefix {prefix}: cannot create the directory {os.path.dirname(prefix)} "
                         f"({existing} is a file); choose another --output-prefix")


def make_output_directory(prefix):
    directory = os.path.dirname(prefix)
    try:
        os.makedirs(directory or ".", exist_ok=True)
    except OSError as error:
        raise InputError(f"--output-prefix {prefix}: cannot create the directory {directory} "
                         f"({error.strerror})") from None


def main(argv=None):
    try:
        args = parse_args(argv)
        with open_input(args.input) as input_file:
            check_output_directory(args.output_prefix)
            preprocess(args, input_file)
    except UserError as error:  # bad flags, input, tokenizer files or output location: exit 2, as argparse
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the system failed (a disk full, an I/O error), not the command line
        print(f"{PROG}: error: {error.filename or 'output'}: {error.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; no output was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
