"""Local data: the byte tokenizer round-trips and reloads, the text dataset is built from local
files, the stdlib corpus needs no download, and bad files give clear errors."""

import pytest
from transformers import AutoTokenizer

from hfstream.cli.data import EOS, build_stdlib_corpus, byte_tokenizer, load_text_dataset, train_bpe_tokenizer


def test_byte_tokenizer_roundtrip_and_reload(tmp_path):
    tok = byte_tokenizer()
    text = "def f(x):\n    return x  # ünïcödé ✓"
    ids = tok(text).input_ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok(EOS).input_ids == [256] and len(tok) == 257 and tok.pad_token == EOS
    tok.save_pretrained(tmp_path / "tok")
    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert again(text).input_ids == ids and again.decode(ids) == text


def test_stdlib_corpus_and_dataset(tmp_path):
    corpus = build_stdlib_corpus(tmp_path, max_bytes=50_000)
    assert 45_000 <= corpus.stat().st_size <= 50_000
    assert "def " in corpus.read_text()
    ds = load_text_dataset(corpus, byte_tokenizer(), block_size=64, validation_fraction=0.1,
                           cache_dir=str(tmp_path / "cache"))
    train, val = ds["train"], ds["validation"]
    assert len(train) > 500 and len(val) > 50
    row = train[0]
    assert len(row["input_ids"]) == 64 and row["labels"] == row["input_ids"] and sum(row["attention_mask"]) == 64
    # Blocks are a cut of the corpus bytes: the first block (in file order) is its first 64 bytes.
    plain = load_text_dataset(corpus, byte_tokenizer(), block_size=64, cache_dir=str(tmp_path / "cache"))
    assert bytes(plain[0]["input_ids"]) == corpus.read_bytes()[:64]


def test_trained_bpe_tokenizer(tmp_path):
    corpus = build_stdlib_corpus(tmp_path, max_bytes=100_000)
    tok = train_bpe_tokenizer([corpus], vocab_size=400)
    text = "import os\nfor i in range(10):\n    print(i)"
    ids = tok(text).input_ids
    assert len(ids) < len(text.encode()) and tok.decode(ids) == text and len(tok) <= 400


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_files.*nope.txt"):
        load_text_dataset(tmp_path / "nope.txt", byte_tokenizer())


def test_empty_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="data_files.*empty"):
        load_text_dataset(empty, byte_tokenizer())


def test_too_little_text_for_one_block(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("tiny\n")
    with pytest.raises(ValueError, match="block_size=128"):
        load_text_dataset(small, byte_tokenizer(), block_size=128, cache_dir=str(tmp_path / "cache"))


def test_no_files_and_bad_block_size(tmp_path):
    with pytest.raises(ValueError, match="data_files is empty"):
        load_text_dataset([], byte_tokenizer())
    f = tmp_path / "a.txt"
    f.write_text("hello world\n" * 10)
    with pytest.raises(ValueError, match="block_size"):
        load_text_dataset(f, byte_tokenizer(), block_size=1)
