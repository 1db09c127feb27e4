"""Training data: the corpus, its tokenizer, and the batches of the training script.

Corpus: the King James Bible (4.2 MB of English, public domain), shipped with the repository as
``models/corpus/kjv.txt.xz`` (0.9 MB, xz, read with Python's ``lzma``): no system package and no
network is needed. It is the text of Debian's ``bible-kjv`` package (4.38) as its ``bible`` program
prints it, cleaned by ``clean_kjv``; the file's text is checked against its recorded sha256 on every
load. ``--corpus bible-kjv`` reads it from that program instead, where the package is installed, and
any other UTF-8 text file can be used instead (``--text``).

Tokenizer: a byte-level BPE (Hugging Face ``tokenizers``) trained on the corpus itself, 8192 ids
by default. Byte-level, so any text round-trips; BPE rather than raw bytes so a 2048-token context
holds a few paragraphs (about 4.2 bytes per token here) and the embedding and output layers have
the size of a real LM's; 8192 ids fit uint16 and are a multiple of 64 for the GEMMs.

    python -m models.data prepare                      # the shipped KJV
    python -m models.data prepare --corpus bible-kjv   # the same text from `bible` (apt-get install -y bible-kjv)
    python -m models.data prepare --text FILE.txt      # any UTF-8 text instead

writes, under ``.data/kjv`` (ignored by git; 2.5 MB for the KJV, small enough to carry to a GPU machine
without network): ``tokenizer.json``, ``train.bin`` and ``val.bin`` (uint16 token ids),
``train_documents.bin`` and ``val_documents.bin`` (int64 offsets into them where a document begins)
and ``meta.json``. Every 20th block of 4096 tokens goes to ``val.bin``.

Documents: a document begins at a heading, a non-blank line with a blank line (or the start of the
text) before it and a blank line after it. In the KJV these are exactly its 1189 chapter headings
("Genesis 1"), so a document is a chapter (about 800 tokens); a text without such lines is one
document. A split also begins a document wherever it skips the other split's tokens (its text
jumps there).

Batches are a pure function of (seed, step), so a resumed run sees exactly the batches it would
have seen, and the global batch of a step is the same whatever the number of ranks: rank r takes
its rows out of it. Llama gets windows of seq_len + 1 tokens (inputs and shifted targets), and with
``--pack`` each input token's position in its document (``Batches.positions_at``); BERT
gets windows of seq_len tokens with 15% of the positions masked (80% mask token, 10% a random
token, 10% unchanged) and the original ids as labels there, -100 elsewhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO_ROOT / ".data" / "kjv"
MASK_TOKEN = "<|mask|>"
DEFAULT_VOCAB_SIZE = 8192
VAL_BLOCK_TOKENS = 4096
VAL_EVERY_BLOCKS = 20
MLM_MASK_FRACTION = 0.15
IGNORE_INDEX = -100

# ------------------------------------------------------------------------------------- corpus


# The shipped corpus: the text bible_kjv_text() gives with Debian's bible-kjv 4.38 (and
# bible-kjv-text 4.38), xz-compressed (preset 9). models/ is not part of the tk_ops distribution: the
# demo runs from the checkout, so the file is found next to this module whatever the install.
KJV_XZ = Path(__file__).resolve().parent / "corpus" / "kjv.txt.xz"
KJV_SHA256 = "a26264076eedfef0d541471bda9e2768d84993069c10694c0298fa402d1810e7"  # of the text (UTF-8)
KJV_BYTES = 4_153_206
KJV_SOURCE = "King James Bible, models/corpus/kjv.txt.xz (Debian bible-kjv 4.38, `bible gen1:1-rev22:21`)"
BIBLE_KJV_SOURCE = "King James Bible, Debian package bible-kjv (`bible gen1:1-rev22:21`)"
CORPORA = ("kjv", "bible-kjv")  # --corpus: the shipped text, or Debian's `bible` program


def kjv_text() -> str:
    """The King James Bible shipped in ``models/corpus/kjv.txt.xz``: chapter headings, then one verse
    per line; byte for byte what ``bible_kjv_text()`` gives with Debian's bible-kjv 4.38."""
    try:
        import lzma
    except ImportError:  # a Python built without liblzma
        raise SystemExit(
            "no corpus: this Python has no lzma module (built without liblzma), which reads the shipped "
            f"{KJV_XZ.name}. Use `python -m models.data prepare --corpus bible-kjv` (Debian's bible-kjv package) "
            "or any UTF-8 text file: `python -m models.data prepare --text FILE`"
        ) from None
    if not KJV_XZ.is_file():
        raise SystemExit(
            f"no corpus: {KJV_XZ} is missing from this checkout. Use `python -m models.data prepare --corpus "
            "bible-kjv` (Debian's bible-kjv package) or any UTF-8 text file: `python -m models.data prepare --text FILE`"
        )
    raw = lzma.decompress(KJV_XZ.read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != KJV_SHA256:
        raise SystemExit(f"{KJV_XZ} is not the shipped corpus: its text has sha256 {digest}, expected {KJV_SHA256}")
    return raw.decode("utf-8")


def bible_kjv_text() -> str:
    """The King James Bible from the ``bible`` program of Debian's bible-kjv package: chapter headings,
    then one verse per line (``--corpus bible-kjv``; the source of ``models/corpus/kjv.txt.xz``)."""
    if shutil.which("bible") is None:
        raise SystemExit(
            "no corpus: --corpus bible-kjv reads the King James Bible from Debian's bible-kjv package, whose "
            "`bible` program is not on PATH. Install it with `apt-get install -y bible-kjv` (Debian or Ubuntu, "
            "as root), leave out --corpus for the copy shipped in models/corpus, or train on any UTF-8 text "
            "file: `python -m models.data prepare --text FILE`"
        )
    # a very wide line so that no verse is wrapped
    raw = subprocess.run(["bible", "-l100000", "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    return clean_kjv(raw)


def clean_kjv(raw: str) -> str:
    """Drop the indentation and verse numbers the ``bible`` program prints: ``  12 And ...`` -> ``And ...``."""
    lines = (re.sub(r"^\s+\d+ ", "", line).rstrip() for line in raw.strip().splitlines())
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """A byte-level BPE tokenizer (``tokenizers``) with one special token, the MLM mask."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tokenizer = HFTokenizer.from_file(str(path))
        self.mask_id = self._tokenizer.token_to_id(MASK_TOKEN)
        self.vocab_size = self._tokenizer.get_vocab_size()

    @staticmethod
    def train(text: str, vocab_size: int, path: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tokenizer = HFTokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[MASK_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
        tokenizer.save(str(path))
        return Tokenizer(path)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def encode_lines(self, text: str) -> np.ndarray:
        """The ids of a long text, encoded line by line in parallel (the same ids: lines end in "\\n")."""
        return self.encode_lines_with_offsets(text.splitlines(keepends=True))[0]

    def encode_lines_with_offsets(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids of the lines, in order; the offset in ids where each line's tokens begin)."""
        encodings = self._tokenizer.encode_batch(lines)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(lines))
        ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64)
        return ids, np.cumsum(lengths) - lengths

    def decode(self, ids) -> str:
        return self._tokenizer.decode(list(ids))


# ---------------------------------------------------------------------------------- prepare


def _is_val(positions: np.ndarray) -> np.ndarray:
    """Whether each token offset lies in a validation block."""
    return positions // VAL_BLOCK_TOKENS % VAL_EVERY_BLOCKS == VAL_EVERY_BLOCKS - 1


def split_train_val(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every VAL_EVERY_BLOCKS-th block of VAL_BLOCK_TOKENS ids goes to validation."""
    is_val = _is_val(np.arange(len(ids)))
    return ids[~is_val], ids[is_val]


def heading_lines(lines: list[str]) -> list[int]:
    """The indices of the lines that begin a document: non-blank, with a blank line (or the start of
    the text) before and a blank line after (the KJV's chapter headings)."""
    blank = [not line.strip() for line in lines]
    return [
        i for i in range(len(lines) - 1)
        if not blank[i] and blank[i + 1] and (i == 0 or blank[i - 1])
    ]  # fmt: skip


def split_document_starts(starts: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Document starts (offsets into all ``total`` ids) as offsets into the train and validation ids,
    as ``split_train_val`` splits them. Each split's first token, and each block of a split that does
    not follow on from the split's previous block, begins a document too."""
    begins = np.zeros(total, dtype=bool)
    begins[starts] = True
    is_val = _is_val(np.arange(total))
    block_starts = np.arange(0, total, VAL_BLOCK_TOKENS)
    jumps = is_val[block_starts] != is_val[np.maximum(block_starts - 1, 0)]
    begins[block_starts[jumps]] = True
    begins[0] = True
    return np.flatnonzero(begins[~is_val]), np.flatnonzero(begins[is_val])


def prepare(out_dir: Path, text: Optional[str] = None, source: str = "", vocab_size: int = DEFAULT_VOCAB_SIZE) -> dict:
    """Train the tokenizer on ``text`` (default: the shipped KJV Bible), write the token files; return meta."""
    if not 257 <= vocab_size <= 2**16:
        raise ValueError(
            f"vocab_size must be in [257, 65536] (256 bytes + the mask token; uint16 ids), got {vocab_size}"
        )
    if text is None:
        text, source = kjv_text(), KJV_SOURCE
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.train(text, vocab_size, out_dir / "tokenizer.json")
    lines = text.splitlines(keepends=True)
    ids, line_offsets = tokenizer.encode_lines_with_offsets(lines)
    train_ids, val_ids = split_train_val(ids)
    train_documents, val_documents = split_document_starts(line_offsets[heading_lines(lines)], len(ids))
    if len(val_ids) == 0:
        raise ValueError(
            f"the text is too short: it must give more than {VAL_BLOCK_TOKENS * (VAL_EVERY_BLOCKS - 1)} tokens"
        )
    train_ids.astype(np.uint16).tofile(out_dir / "train.bin")
    val_ids.astype(np.uint16).tofile(out_dir / "val.bin")
    train_documents.astype(np.int64).tofile(out_dir / "train_documents.bin")
    val_documents.astype(np.int64).tofile(out_dir / "val_documents.bin")
    meta = {
        "source": source,
        "text_bytes": len(text.encode()),
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "tokenizer": "byte-level BPE (tokenizers)",
        "vocab_size": tokenizer.vocab_size,
        "mask_token_id": tokenizer.mask_id,
        "train_tokens": int(len(train_ids)),
        "val_tokens": int(len(val_ids)),
        "documents": "a heading line (between blank lines) begins a document; so does a jump between blocks",
        "train_documents": int(len(train_documents)),
        "val_documents": int(len(val_documents)),
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# ---------------------------------------------------------------------------------- batches


@dataclass
class TokenData:
    """A prepared data directory: token ids (memory-mapped), where documents begin in them (None in a
    directory prepared before documents were recorded) and its meta.json."""

    train: np.ndarray
    val: np.ndarray
    meta: dict
    directory: Path
    train_documents: Optional[np.ndarray] = None
    val_documents: Optional[np.ndarray] = None

    @staticmethod
    def load(directory: Path) -> "TokenData":
        directory = Path(directory)
        if not (directory / "meta.json").exists():
            raise SystemExit(f"no prepared data in {directory}: run `python -m models.data prepare` first")
        meta = json.loads((directory / "meta.json").read_text())
        train = np.memmap(directory / "train.bin", dtype=np.uint16, mode="r")
        val = np.memmap(directory / "val.bin", dtype=np.uint16, mode="r")
        documents = [directory / f"{split}_documents.bin" for split in ("train", "val")]
        if not all(path.exists() for path in documents):
            return TokenData(train, val, meta, directory)
        train_documents, val_documents = (np.fromfile(path, dtype=np.int64) for path in documents)
        return TokenData(train, val, meta, directory, train_documents, val_documents)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.directory / "tokenizer.json")


class Batches:
    """The global batch of each step over one token array, and each rank's rows of it.

    ``kind`` is ``"lm"`` (inputs, targets) or ``"mlm"`` (masked inputs, labels). Windows are
    non-overlapping; each epoch visits them in a fresh random order drawn from (seed, epoch)
    (``shuffle=False``: in order, for evaluation). ``document_starts``: the sorted offsets into ids
    where documents begin (0 among them), for ``positions_at``.
    """

    def __init__(
        self,
        ids: np.ndarray,
        *,
        kind: str,
        seq_len: int,
        global_batch: int,
        seed: int,
        shuffle: bool = True,
        vocab_size: int = 0,
        mask_id: int = -1,
        document_starts: Optional[np.ndarray] = None,
    ) -> None:
        if kind not in ("lm", "mlm"):
            raise ValueError(f"kind must be 'lm' or 'mlm', got {kind!r}")
        self.ids, self.kind, self.seq_len, self.global_batch = ids, kind, seq_len, global_batch
        self.seed, self.shuffle, self.vocab_size, self.mask_id = seed, shuffle, vocab_size, mask_id
        self.document_starts = document_starts
        self.window = seq_len + 1 if kind == "lm" else seq_len
        self.num_windows = (len(ids) - self.window) // seq_len + 1 if len(ids) >= self.window else 0
        self.steps_per_epoch = self.num_windows // global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(ids)} tokens give {self.num_windows} windows of {self.window} tokens: fewer than one "
                f"batch of {global_batch}; lower the batch size or the sequence length"
            )
        self._order_epoch, self._order = -1, None

    def _window_starts(self, step: int) -> torch.Tensor:
        epoch, index = divmod(step, self.steps_per_epoch)
        if not self.shuffle:
            windows = torch.arange(index * self.global_batch, (index + 1) * self.global_batch)
            return windows * self.seq_len
        if epoch != self._order_epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order_epoch, self._order = epoch, torch.randperm(self.num_windows, generator=generator)
        windows = self._order[index * self.global_batch : (index + 1) * self.global_batch]
        return windows * self.seq_len

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the whole batch of ``step``, each (global_batch, seq_len) int64."""
        rows = np.stack([self.ids[start : start + self.window] for start in self._window_starts(step).tolist()])
        tokens = torch.from_numpy(rows.astype(np.int64))
        if self.kind == "lm":
            return tokens[:, :-1], tokens[:, 1:]
        return self._mask(tokens, step)

    def positions_at(self, step: int) -> torch.Tensor:
        """(global_batch, seq_len) int64: each input token's position in its document, counted from the
        document's first token or from the row's, whichever is later (``models.layers.PackedDocuments``)."""
        if self.document_starts is None:
            raise ValueError("these batches have no document starts")
        row_starts = self._window_starts(step).numpy()[:, None]
        tokens = row_starts + np.arange(self.seq_len)
        document = self.document_starts[np.searchsorted(self.document_starts, tokens, side="right") - 1]
        return torch.from_numpy(tokens - np.maximum(document, row_starts))

    def _mask(self, tokens: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step + (0 if self.shuffle else 2**40))
        draw = torch.rand(tokens.shape, generator=generator)
        action = torch.rand(tokens.shape, generator=generator)
        random_ids = torch.randint(0, self.vocab_size, tokens.shape, generator=generator)
        selected = draw < MLM_MASK_FRACTION
        labels = torch.where(selected, tokens, IGNORE_INDEX)
        inputs = torch.where(selected & (action < 0.8), self.mask_id, tokens)
        inputs = torch.where(selected & (action >= 0.8) & (action < 0.9), random_ids, inputs)
        return inputs, labels


# --------------------------------------------------------------------------------------- CLI


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.data", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="train the tokenizer and write the token files")
    corpus = prep.add_mutually_exclusive_group()
    corpus.add_argument(
        "--corpus",
        choices=CORPORA,
        default="kjv",
        help="kjv (default): the King James Bible shipped in models/corpus; bible-kjv: the same text from "
        "the `bible` program of Debian's bible-kjv package",
    )
    corpus.add_argument("--text", type=Path, help="a UTF-8 text file to use instead of the KJV Bible")
    prep.add_argument(
        "--out", type=Path, default=DEFAULT_DATA_DIR, help=f"output directory (default {DEFAULT_DATA_DIR})"
    )
    prep.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = parser.parse_args(argv)
    if args.text and not args.text.is_file():
        parser.error(f"--text: no file {args.text}")
    if args.text:
        text, source = args.text.read_text(encoding="utf-8"), str(args.text)
    elif args.corpus == "bible-kjv":
        text, source = bible_kjv_text(), BIBLE_KJV_SOURCE
    else:
        text, source = kjv_text(), KJV_SOURCE
    meta = prepare(args.out, text, source=source, vocab_size=args.vocab_size)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(
        f"{meta['text_bytes'] / 1e6:.2f} MB of text -> {meta['train_tokens']:,} train + {meta['val_tokens']:,} "
        f"val tokens (vocab {meta['vocab_size']}), {size / 1e6:.1f} MB in {args.out}"
    )


if __name__ == "__main__":
    main()
