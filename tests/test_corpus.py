"""models.data's corpora: the King James Bible shipped in models/corpus/kjv.txt.xz (the default, no
system package needed), the same text from Debian's ``bible`` program (``--corpus bible-kjv``, where
installed) and any text file (``--text``)."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from models import data

REPO_ROOT = Path(__file__).resolve().parent.parent
# sha256 of the text of Debian bible-kjv 4.38 as models/data.py's bible_kjv_text() gives it (recorded
# here, not read from models/data.py, so that a changed file and a changed constant cannot agree)
KJV_SHA256 = "a26264076eedfef0d541471bda9e2768d84993069c10694c0298fa402d1810e7"


def prepare_cli(out: Path, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ) if path is None else {**os.environ, "PATH": path}
    return subprocess.run(
        [sys.executable, "-m", "models.data", "prepare", "--out", str(out), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


def test_shipped_kjv_is_the_recorded_text():
    shipped = lzma.decompress(data.KJV_XZ.read_bytes())
    assert hashlib.sha256(shipped).hexdigest() == KJV_SHA256 == data.KJV_SHA256
    assert data.KJV_XZ.stat().st_size < 2_000_000 and len(shipped) == data.KJV_BYTES
    text = data.kjv_text()
    assert text.encode() == shipped
    assert text.startswith("Genesis 1\n\nIn the beginning God created the heaven and the earth.\n")
    assert text.endswith("\nThe grace of our Lord Jesus Christ be with you all. Amen.\n")
    lines = text.splitlines()
    headings = [line for line in lines if re.fullmatch(r"(?:[1-3] )?[A-Z][A-Za-z ]* \d+", line)]  # "1 Kings 3"
    # 1,189 chapter headings, a blank line after each and before each but the first, 31,102 verses
    assert (len(lines), lines.count(""), len(headings)) == (34_668, 2_377, 1_189)
    assert headings[0] == "Genesis 1" and headings[-1] == "Revelation 22"


@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian's bible-kjv package is not installed")
def test_shipped_kjv_is_what_the_bible_program_prints():
    assert data.bible_kjv_text() == data.kjv_text()


def test_a_changed_corpus_file_is_refused(tmp_path, monkeypatch):
    changed = tmp_path / "kjv.txt.xz"
    changed.write_bytes(lzma.compress(data.kjv_text().replace("Amen.", "Amen!").encode()))
    monkeypatch.setattr(data, "KJV_XZ", changed)
    with pytest.raises(SystemExit, match="is not the shipped corpus: its text has sha256"):
        data.kjv_text()
    monkeypatch.setattr(data, "KJV_XZ", tmp_path / "missing.txt.xz")
    with pytest.raises(SystemExit, match=r"missing from this checkout.*--corpus bible-kjv.*--text FILE"):
        data.kjv_text()


def test_prepare_uses_the_shipped_kjv_without_any_system_package(tmp_path):
    """The README's `python -m models.data prepare`, with no `bible` program on PATH (a small vocabulary
    here to keep the tokenizer's training short)."""
    result = prepare_cli(tmp_path, "--vocab-size", "300", path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["text_sha256"] == KJV_SHA256 and meta["text_bytes"] == data.KJV_BYTES
    assert "models/corpus/kjv.txt.xz" in meta["source"] and meta["vocab_size"] == 300
    assert "4.15 MB of text" in result.stdout


def test_prepare_text_file(tmp_path):
    rng = random.Random(0)
    words = "and the king went unto city of water bread land people".split()
    text = "".join(" ".join(rng.choice(words) for _ in range(12)).capitalize() + ".\n" for _ in range(8000))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    result = prepare_cli(out, "--text", str(corpus), "--vocab-size", "300", path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["source"] == str(corpus) and meta["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()


def test_prepare_corpus_and_text_exclude_each_other(tmp_path):
    result = prepare_cli(tmp_path, "--corpus", "bible-kjv", "--text", "x.txt")
    assert result.returncode == 2 and "not allowed with argument" in result.stderr
    result = prepare_cli(tmp_path, "--text", str(tmp_path / "missing.txt"))
    assert result.returncode == 2 and "--text: no file" in result.stderr
