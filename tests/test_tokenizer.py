"""megatron.training.tokenizer: the shipped vocabularies load, round-trip text, expose the ids
megatron-core's datasets read, and every bad file fails with a one-line TokenizerError."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from megatron.training.errors import UserError
from megatron.training.tokenizer import (
    BertWordPieceTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    TokenizerError,
    build_tokenizer,
    vocab_size_with_padding,
)

DATASETS = Path(__file__).resolve().parents[1] / "datasets"
GPT_VOCAB, GPT_MERGES = str(DATASETS / "gpt" / "vocab.json"), str(DATASETS / "gpt" / "merges.txt")
BERT_VOCAB = str(DATASETS / "bert" / "vocab.txt")
TEXT = "Héllo wörld — “quotes”, tabs\tand\nnewlines 🎉 def f(x): return x ** 2"


@pytest.fixture(scope="module")
def gpt2():
    return GPT2BPETokenizer(GPT_VOCAB, GPT_MERGES)


def test_gpt2_bpe_round_trips_any_text_and_ends_documents_with_endoftext(gpt2):
    assert isinstance(gpt2, MegatronLegacyTokenizer)
    assert gpt2.vocab_size == 8192
    assert gpt2.eod == gpt2.vocab["<|endoftext|>"] == 8191
    assert gpt2.detokenize(gpt2.tokenize(TEXT)) == TEXT
    # Written inside a text, <|endoftext|> is ordinary text, as in GPT-2.
    assert gpt2.eod not in gpt2.tokenize("a <|endoftext|> b")
    assert gpt2.detokenize([gpt2.eod]) == "<|endoftext|>"
    assert all(gpt2.vocab[token] == token_id for token_id, token in gpt2.inv_vocab.items())


def test_bert_lower_case_ignores_case_and_exposes_the_masked_lm_ids():
    bert = BertWordPieceTokenizer(BERT_VOCAB, lower_case=True)
    assert bert.vocab_size == 8192
    assert bert.tokenize("Python CLASS Définition") == bert.tokenize("python class definition")
    assert bert.vocab["[UNK]"] not in bert.tokenize("The import statement")
    assert [bert.inv_vocab[i] for i in (bert.pad, bert.cls, bert.sep, bert.mask)] == [
        "[PAD]", "[CLS]", "[SEP]", "[MASK]"]
    assert bert.eod == bert.sep
    assert bert.detokenize(bert.tokenize("Lambda expressions, don't they?")) == "lambda expressions , don ' t they ?"


def test_bert_case_keeps_case(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Hello", "hello", "##s"]) + "\n")
    assert BertWordPieceTokenizer(str(vocab), lower_case=False).tokenize("Hello hellos") == [5, 6, 7]
    assert BertWordPieceTokenizer(str(vocab), lower_case=True).tokenize("Hello hellos") == [6, 6, 7]


@pytest.fixture
def tokenizer_json(tmp_path):
    """The shipped GPT-2 BPE saved as a Hugging Face tokenizer.json."""
    tokenizer = Tokenizer(models.BPE.from_file(GPT_VOCAB, GPT_MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def test_huggingface_loads_a_tokenizer_json_or_its_folder_offline(tokenizer_json, gpt2):
    for model in (tokenizer_json, tokenizer_json.parent):
        tokenizer = HuggingFaceTokenizer(str(model))
        assert tokenizer.tokenize(TEXT) == gpt2.tokenize(TEXT)
        assert tokenizer.detokenize(tokenizer.tokenize(TEXT)) == TEXT
        assert tokenizer.eod == gpt2.eod  # <|endoftext|>, a known end token
    (tokenizer_json.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "!"}}))
    assert HuggingFaceTokenizer(str(tokenizer_json.parent)).eod == gpt2.vocab["!"]


def test_null_tokenizer_reads_ids_and_puts_eod_after_the_vocabulary():
    tokenizer = NullTokenizer(1000)
    assert tokenizer.tokenize(" 5 17\n999 ") == [5, 17, 999]
    assert (tokenizer.eod, tokenizer.vocab_size) == (1000, 1001)
    assert tokenizer.detokenize([5, 17, 1000]) == "5 17 1000"
    for text in ("12x", "1001", "-1"):
        with pytest.raises(TokenizerError, match="is not a token id"):
            tokenizer.tokenize(text)


@pytest.mark.parametrize("tp, padded", [(1, 8192), (2, 8192), (4, 8192), (8, 8192), (128, 16384)])
def test_vocab_size_with_padding_rounds_up_to_divisible_by_times_tp(tp, padded):
    assert vocab_size_with_padding(8192, 128, tp) == padded
    assert vocab_size_with_padding(50257, 128, 1) == 50304


def test_build_tokenizer_sets_the_padded_vocab_size_unless_given():
    args = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=1000,
                              make_vocab_size_divisible_by=128, tensor_model_parallel_size=2)
    assert isinstance(build_tokenizer(args), NullTokenizer)
    assert args.padded_vocab_size == 1024
    args.padded_vocab_size = 5000  # e.g. from a checkpoint
    build_tokenizer(args)
    assert args.padded_vocab_size == 5000


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def _bad_gpt2_files(tmp_path):
    """name -> (GPT2BPETokenizer flags, words its error must contain)."""
    merges = Path(GPT_MERGES).read_text(encoding="utf-8").splitlines()
    return {
        "no vocab flag": (dict(vocab_file=None, merge_file=GPT_MERGES), ["--vocab-file is required"]),
        "missing vocab": (dict(vocab_file=str(tmp_path / "nope.json"), merge_file=GPT_MERGES),
                          ["--vocab-file", "nope.json", "no such file"]),
        "missing merges": (dict(vocab_file=GPT_VOCAB, merge_file=str(tmp_path / "nope.txt")),
                           ["--merge-file", "nope.txt", "no such file"]),
        "malformed vocab": (dict(vocab_file=_write(tmp_path / "bad.json", '{"a": 0,\n "b" 1}'),
                                 merge_file=GPT_MERGES),
                            ["--vocab-file", "bad.json", "not valid JSON", "line 2"]),
        "vocab not a mapping": (dict(vocab_file=_write(tmp_path / "list.json", "[1, 2]"), merge_file=GPT_MERGES),
                                ["--vocab-file", "list.json", "mapping tokens to integer ids"]),
        "vocab without eod": (dict(vocab_file=_write(tmp_path / "small.json", json.dumps({"a": 0})),
                                   merge_file=_write(tmp_path / "empty.txt", "#version: 0.2\n")),
                              ["--vocab-file", "small.json", "'<|endoftext|>'"]),
        "merge of unknown token": (dict(vocab_file=GPT_VOCAB, merge_file=_write(
            tmp_path / "other.txt", "\n".join(merges[:3] + ["Ġ qqqq"]) + "\n")),
            ["--merge-file", "other.txt:4", "'qqqq'", "--vocab-file", "same tokenizer"]),
        "malformed merge line": (dict(vocab_file=GPT_VOCAB, merge_file=_write(tmp_path / "three.txt", "a b c\n")),
                                 ["--merge-file", "three.txt:1", "two tokens"]),
    }


def test_every_bad_gpt2_file_raises_one_line_naming_flag_and_file(tmp_path):
    for name, (flags, words) in _bad_gpt2_files(tmp_path).items():
        with pytest.raises(TokenizerError) as raised:
            build_tokenizer(argparse.Namespace(tokenizer_type="GPT2BPETokenizer", **flags))
        message = str(raised.value)
        assert "\n" not in message and all(word in message for word in words), (name, message)


@pytest.mark.parametrize("flags, words", [
    (dict(tokenizer_type="BertWordPieceCase", vocab_file="missing.txt"), ["--vocab-file missing.txt", "no such file"]),
    (dict(tokenizer_type="HuggingFaceTokenizer"), ["--tokenizer-model is required"]),
    (dict(tokenizer_type="NullTokenizer"), ["--vocab-size", "required"]),
    (dict(tokenizer_type="SentencePieceTokenizer"), ["--tokenizer-type SentencePieceTokenizer", "GPT2BPETokenizer"]),
])
def test_missing_flags_and_unknown_types_raise_one_line(flags, words):
    with pytest.raises(TokenizerError) as raised:
        build_tokenizer(argparse.Namespace(**flags))
    assert "\n" not in str(raised.value) and all(word in str(raised.value) for word in words)


def test_bad_bert_vocab_and_huggingface_files_raise_one_line(tmp_path):
    no_mask = _write(tmp_path / "vocab.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n")
    twice = _write(tmp_path / "twice.txt", "[PAD]\nhello\n[UNK]\nhello\n")
    (tmp_path / "empty_folder").mkdir()
    cases = [
        (lambda: BertWordPieceTokenizer(no_mask, lower_case=True), ["vocab.txt", "'[MASK]'"]),
        (lambda: BertWordPieceTokenizer(twice, lower_case=True), ["twice.txt:4", "'hello'", "line 2"]),
        (lambda: HuggingFaceTokenizer(str(tmp_path / "empty_folder")), ["no tokenizer.json"]),
        (lambda: HuggingFaceTokenizer(_write(tmp_path / "t.json", '{"model": 1}')),
         ["t.json", "not a valid tokenizer.json"]),
    ]
    for build, words in cases:
        with pytest.raises(TokenizerError) as raised:
            build()
        assert "\n" not in str(raised.value) and all(word in str(raised.value) for word in words), str(raised.value)


def test_tokenizer_error_is_a_user_error_and_a_value_error():
    assert issubclass(TokenizerError, UserError) and issubclass(TokenizerError, ValueError)


def test_vocabulary_order_is_the_same_in_every_process():
    # megatron-core's BERT dataset picks random replacement tokens by position in inv_vocab.
    script = ("from megatron.training.tokenizer import BertWordPieceTokenizer as T; "
              f"print(list(T({BERT_VOCAB!r}, lower_case=True).inv_vocab)[:50])")
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
               for _ in range(3)}
    assert len(outputs) == 1 and outputs.pop().startswith("[0, 1, 2, 3, 4, 5")
