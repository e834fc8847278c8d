import subprocess
import sys

import pytest
from helpers.launch import REPO


def _preprocess(out_dir, corpus, extra):
    subprocess.run([sys.executable, str(REPO / "tools/preprocess_data.py"), "--input", str(corpus),
                    "--output-prefix", str(out_dir / "data"), "--workers", "1", *extra],
                   check=True, capture_output=True, text=True)


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory):
    """The sample GPT corpus, preprocessed: the --data-path prefix."""
    out = tmp_path_factory.mktemp("gpt_data")
    _preprocess(out, REPO / "datasets/gpt/corpus.jsonl",
                ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(REPO / "datasets/gpt/vocab.json"),
                 "--merge-file", str(REPO / "datasets/gpt/merges.txt"), "--append-eod"])
    return out / "data_text_document"


@pytest.fixture(scope="session")
def bert_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("bert_data")
    _preprocess(out, REPO / "datasets/bert/corpus.jsonl",
                ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(REPO / "datasets/bert/vocab.txt"),
                 "--split-sentences"])
    return out / "data_text_sentence"
