"""tools/preprocess_data.py as a user runs it: the written datasets decode back to the input,
and bad input is one line on stderr, a non-zero exit and no output files."""

import json
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.training.tokenizer import BertWordPieceTokenizer, GPT2BPETokenizer

ROOT = Path(__file__).resolve().parents[1]
TOOL = str(ROOT / "tools" / "preprocess_data.py")
GPT_VOCAB = str(ROOT / "datasets" / "gpt" / "vocab.json")
GPT_MERGES = str(ROOT / "datasets" / "gpt" / "merges.txt")
BERT_VOCAB = str(ROOT / "datasets" / "bert" / "vocab.txt")
GPT2_FLAGS = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", GPT_VOCAB, "--merge-file", GPT_MERGES]
SENTENCES = ["Sentences end here.", " Or here!", " \"Quoted?\"", "  (Brackets.)", " 3 more...", "\n\nnew paragraph"]
DOCUMENTS = 25


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Shipped documents plus one of known sentences, a blank line (skipped) between two of them."""
    lines = (ROOT / "datasets" / "gpt" / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    known = json.dumps({"text": "".join(SENTENCES), "id": "known"})
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("\n".join(lines[:DOCUMENTS - 2] + ["", known, lines[-1]]) + "\n", encoding="utf-8")
    return path


def documents(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def run_together(commands):
    """Run the tool once per {name: flags} all at once, as each run spends seconds importing
    megatron-core; name -> CompletedProcess."""
    processes = {name: subprocess.Popen([sys.executable, TOOL, *map(str, flags)], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
                 for name, flags in commands.items()}
    outputs = {name: process.communicate(timeout=300) for name, process in processes.items()}
    return {name: subprocess.CompletedProcess(process.args, process.returncode, *outputs[name])
            for name, process in processes.items()}


def read_dataset(prefix):
    """The dataset's documents, each a list of its sequences (lists of token ids)."""
    dataset = IndexedDataset(str(prefix))
    bounds = dataset.document_indices
    return [[dataset[i].tolist() for i in range(start, end)] for start, end in zip(bounds[:-1], bounds[1:])]


@pytest.fixture(scope="module")
def good_runs(corpus, tmp_path_factory):
    """(name -> finished run, the folder they wrote into) for the runs whose output is checked."""
    out = tmp_path_factory.mktemp("out")
    return run_together({
        "gpt2": ["--input", corpus, "--output-prefix", out / "gpt2" / "gpt", *GPT2_FLAGS, "--append-eod",
                 "--split-sentences", "--workers", 2, "--json-keys", "text", "id", "--log-interval", 10],
        "bert": ["--input", corpus, "--output-prefix", out / "bert", "--tokenizer-type", "BertWordPieceLowerCase",
                 "--vocab-file", BERT_VOCAB],
    }), out


def test_gpt2_sentences_join_back_into_each_text_and_key_then_eod_with_two_workers(good_runs, corpus):
    runs, out = good_runs
    assert runs["gpt2"].returncode == 0, runs["gpt2"].stderr
    assert "Processed 10 documents (" in runs["gpt2"].stderr
    assert f"Processed {DOCUMENTS} documents (" in runs["gpt2"].stderr.splitlines()[-1]
    assert sorted(path.name for path in (out / "gpt2").iterdir()) == [
        "gpt_id_sentence.bin", "gpt_id_sentence.idx", "gpt_text_sentence.bin", "gpt_text_sentence.idx"]
    gpt2 = GPT2BPETokenizer(GPT_VOCAB, GPT_MERGES)
    for key in ("text", "id"):
        written = read_dataset(out / "gpt2" / f"gpt_{key}_sentence")
        assert len(written) == DOCUMENTS
        for sentences, document in zip(written, documents(corpus)):
            ids = [token_id for sentence in sentences for token_id in sentence]
            assert ids[-1] == gpt2.eod and gpt2.detokenize(ids[:-1]) == document[key]
    sentences = read_dataset(out / "gpt2" / "gpt_text_sentence")
    assert sum(map(len, sentences)) > 2 * DOCUMENTS
    assert [gpt2.detokenize(ids) for ids in sentences[DOCUMENTS - 2]] == SENTENCES[:-1] + [
        SENTENCES[-1] + "<|endoftext|>"]


def _lower_case(text):
    """What BERT's uncased normalization does to text: lower case, accents stripped."""
    return "".join(c for c in unicodedata.normalize("NFD", text.lower()) if unicodedata.category(c) != "Mn")


def test_bert_lower_case_documents_decode_to_the_lowercased_text(good_runs, corpus):
    runs, out = good_runs
    assert runs["bert"].returncode == 0, runs["bert"].stderr
    written = read_dataset(out / "bert_text_document")
    bert = BertWordPieceTokenizer(BERT_VOCAB, lower_case=True)
    assert len(written) == DOCUMENTS
    for (ids,), document in zip(written, documents(corpus)):
        # WordPiece keeps no whitespace: compare the characters.
        assert "".join(bert.detokenize(ids).split()) == "".join(_lower_case(document["text"]).split())


# name -> (flags, words the one error line must contain); {corpus} is the corpus fixture, {dir}
# the folder of the bad_runs fixture, which writes bad_json.jsonl, other_merges.txt and a_file there.
BAD_INPUTS = {
    "missing input": (["--input", "{dir}/nope.jsonl", *GPT2_FLAGS], ["--input", "nope.jsonl", "no such file"]),
    "malformed json": (["--input", "{dir}/bad_json.jsonl", *GPT2_FLAGS, "--workers", "2"],
                       ["bad_json.jsonl:17: not valid JSON"]),
    "missing key": (["--input", "{corpus}", *GPT2_FLAGS, "--json-keys", "text", "title"],
                    ["corpus.jsonl:1: no key 'title'"]),
    "missing vocab": (["--input", "{corpus}", *GPT2_FLAGS, "--vocab-file", "{dir}/v.json"],
                      ["--vocab-file", "v.json", "no such file"]),
    "missing merges": (["--input", "{corpus}", *GPT2_FLAGS[:4]], ["--merge-file is required"]),
    "vocab and merges mismatch": (["--input", "{corpus}", *GPT2_FLAGS, "--merge-file", "{dir}/other_merges.txt"],
                                  ["other_merges.txt:3", "'zz'", "same tokenizer"]),
    "unknown tokenizer type": (["--input", "{corpus}", "--tokenizer-type", "Llama"],
                               ["--tokenizer-type Llama is not supported", "GPT2BPETokenizer"]),
    "uncreatable output directory": (["--input", "{corpus}", *GPT2_FLAGS, "--output-prefix", "{dir}/a_file/out/gpt"],
                                     ["--output-prefix", "cannot create the directory"]),
    # sysfs refuses new files even to root, so this holds however the tests run.
    "unwritable output location": (["--input", "{corpus}", *GPT2_FLAGS, "--output-prefix", "/sys/gpt"],
                                   ["--output-prefix /sys/gpt: cannot write in /sys", "choose a writable location"]),
    "flag error with a new output directory": (
        ["--input", "{corpus}", *GPT2_FLAGS[:4], "--output-prefix", "{dir}/new_directory/gpt"],
        ["--merge-file is required"]),
}


@pytest.fixture(scope="module")
def bad_runs(corpus, tmp_path_factory):
    """name -> (finished run, its output folder, which holds a user file a failed run must leave)."""
    directory = tmp_path_factory.mktemp("bad")
    lines = corpus.read_text(encoding="utf-8").splitlines()
    (directory / "bad_json.jsonl").write_text("\n".join(lines[:16] + ['{"text": "cut'] + lines[16:]), encoding="utf-8")
    (directory / "other_merges.txt").write_text("#version: 0.2\nĠ t\nzz qq\n", encoding="utf-8")
    (directory / "a_file").write_text("")
    commands, outputs = {}, {}
    for name, (flags, _) in BAD_INPUTS.items():
        outputs[name] = directory / name.replace(" ", "_")
        outputs[name].mkdir()
        (outputs[name] / "gpt_text_document.bin").write_bytes(b"user data")
        # argparse keeps the last of a repeated flag, so a case's own --output-prefix wins.
        commands[name] = [flag.format(corpus=corpus, dir=directory)
                          for flag in ["--output-prefix", f"{outputs[name]}/gpt", *flags]]
    return {name: (result, outputs[name]) for name, result in run_together(commands).items()}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_one_line_nonzero_exit_and_no_output(bad_runs, name):
    result, output = bad_runs[name]
    assert result.returncode == 2, result.stderr  # as argparse and the other tools do for user errors
    assert "Traceback" not in result.stderr and "/." not in result.stderr  # never a hidden temporary name
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("preprocess_data.py: error: "), result.stderr
    assert all(word in result.stderr for word in BAD_INPUTS[name][1]), result.stderr
    assert [path.name for path in output.iterdir()] == ["gpt_text_document.bin"]
    assert (output / "gpt_text_document.bin").read_bytes() == b"user data"


def test_failed_flag_check_leaves_no_new_output_directory(bad_runs):
    result, output = bad_runs["flag error with a new output directory"]
    assert result.returncode == 2 and not (output.parent / "new_directory").exists(), result.stderr
