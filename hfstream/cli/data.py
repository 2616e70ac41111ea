"""Local data, no hub: a byte-level tokenizer, a text dataset from local files, and a demo
corpus built from the Python standard library's own source files.

Nothing here downloads: the tokenizer is either the 256 bytes themselves (plus an end-of-text
token) or a byte-level BPE trained on your files; the dataset comes from
``datasets.load_dataset("text", data_files=...)``. This module imports `datasets`, so the
library core (`hfstream/__init__`) does not import it.

    >>> from hfstream.cli.data import byte_tokenizer, build_stdlib_corpus, load_text_dataset
    >>> tok = byte_tokenizer()
    >>> tok("hé").input_ids
    [104, 195, 169]
"""

from __future__ import annotations

import os
import socket
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Sequence

EOS = "<|endoftext|>"


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte b -> one character).

    Source: openai/gpt-2 ``encoder.py``. Printable Latin-1 bytes map to themselves; the rest
    are shifted past 255, so every byte has a visible, whitespace-free symbol.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _wrap(tokenizer_object, model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object,
        eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS,
        model_max_length=model_max_length,
    )


def byte_tokenizer(model_max_length: int = 1024):
    """A `PreTrainedTokenizerFast` whose ids are the UTF-8 bytes (0-255) plus ``<|endoftext|>`` (256).

    Vocabulary size 257; it saves with ``save_pretrained`` and reloads with
    ``AutoTokenizer.from_pretrained(path)`` like any other tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab[EOS] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return _wrap(tok, model_max_length)


def train_bpe_tokenizer(files: Sequence[str | os.PathLike], vocab_size: int = 1024, model_max_length: int = 1024):
    """A byte-level BPE tokenizer trained here, on ``files`` (no download, a few seconds per MB)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    paths = _check_files(files, "files")
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least 257 (256 bytes + {EOS})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in paths], trainer)
    return _wrap(tok, model_max_length)


def build_stdlib_corpus(out_dir: str | os.PathLike, max_bytes: int = 4_000_000) -> Path:
    """Write ``stdlib_corpus.txt`` in ``out_dir`` from this Python's standard library sources.

    Every Python installation has them, so the demo needs no download and commits no data.
    Files are taken in sorted order (test suites left out) until ``max_bytes``; the result is
    the same on every machine with the same Python version. Returns the file's path.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes} must be > 0")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = Path(out_dir) / "stdlib_corpus.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and out.stat().st_size > 0:
        return out
    sources = sorted(p for p in stdlib.rglob("*.py")
                     if "site-packages" not in p.parts and not any(part in ("test", "tests", "idlelib") for part in p.parts))
    written = 0
    # A name of its own per process: on several nodes sharing a file system (or two "nodes" on one
    # machine) each node's main process builds the corpus at once; a shared temporary name let
    # one rename the file away from under the other (seen in the SLURM template's test).
    tmp = out.with_name(f"{out.stem}.{socket.gethostname()}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for path in sources:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            chunk = text.encode("utf-8")[: max_bytes - written].decode("utf-8", errors="ignore")
            f.write(chunk)
            written += len(chunk.encode("utf-8"))
            if written >= max_bytes:
                break
    if written == 0:
        raise RuntimeError(f"no readable .py files under the standard library at {stdlib}")
    os.replace(tmp, out)   # atomic: several ranks may build it at once
    return out


def _check_files(files, name: str) -> list[Path]:
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = [Path(f) for f in files]
    if not paths:
        raise ValueError(f"{name} is empty: pass one or more local text files")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"{name}: {str(p)!r} does not exist or is not a file")
        if p.stat().st_size == 0:
            raise ValueError(f"{name}: {str(p)!r} is empty; give a text file with content")
    return paths


def load_text_dataset(
    data_files: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer,
    block_size: int = 128,
    validation_fraction: float = 0.0,
    cache_dir: str | None = None,
    seed: int = 0,
):
    """Local text files -> blocks of ``block_size`` token ids for causal language modelling.

    Built with ``datasets.load_dataset("text", data_files=...)``: lines (line breaks kept) are
    tokenized, concatenated in file order, and cut into equal blocks
    (``input_ids``, ``attention_mask``, ``labels`` = ``input_ids``; the model shifts).

    Returns:
        a `datasets.Dataset`, or a `DatasetDict` with ``train`` and ``validation`` when
        ``validation_fraction > 0``.
    """
    from .extras import require

    datasets = require("datasets", "demo")
    paths = _check_files(data_files, "data_files")
    if block_size < 2:
        raise ValueError(f"block_size={block_size} must be >= 2")
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction={validation_fraction} must be in [0, 1)")
    raw = datasets.load_dataset("text", data_files={"train": [str(p) for p in paths]}, split="train",
                                cache_dir=cache_dir, keep_linebreaks=True)

    def tokenize(batch):
        return {"input_ids": tokenizer(batch["text"], add_special_tokens=False)["input_ids"]}

    def group(batch):
        ids = [t for seq in batch["input_ids"] for t in seq]
        n = (len(ids) // block_size) * block_size
        blocks = [ids[i:i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks], "labels": [list(b) for b in blocks]}

    tokens = raw.map(tokenize, batched=True, remove_columns=["text"], desc="tokenize")
    blocks = tokens.map(group, batched=True, batch_size=1000, desc=f"group into {block_size}-token blocks")
    if len(blocks) == 0:
        total = sum(len(x) for x in tokens["input_ids"])
        raise ValueError(f"data_files hold {total} tokens, fewer than one block of block_size={block_size}; "
                         "add text or lower block_size")
    if validation_fraction > 0:
        return _split(blocks, validation_fraction, seed)
    return blocks


def _split(blocks, fraction: float, seed: int):
    from .extras import require

    datasets = require("datasets", "demo")
    parts = blocks.train_test_split(test_size=fraction, seed=seed, shuffle=True)
    return datasets.DatasetDict(train=parts["train"], validation=parts["test"])
