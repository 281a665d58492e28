"""Tests for prepare.py, cram.py and glue.py: CPU only, no network, tiny data made here."""
import base64, gzip, http.server, io, json, math, os, random, signal, subprocess, sys, threading, time, zipfile
from dataclasses import asdict

import numpy as np
import pytest
import torch

import cram
import glue
import prepare
from cram import Crammed, ModelConfig
from conftest import *  # noqa  (TEMPORARY split)
from conftest import Handler, make_docs, prep, write_jsonl, HERE  # noqa

# ----------------------------------------------------------------------------- prepare.py
def test_tokenizer_round_trip_and_specials(tmp_path):
    docs = make_docs(100) + ["Café NAÏVE  façade\n\twith [MASK] and [SEP] and [CLS] inside, ünïcödé 123_456 ²½ ok"]
    meta, out = prep(str(tmp_path), docs)
    enc = prepare.load_tokenizer(prepare.read_prepared(out)[1])
    assert meta["vocab_size"] == enc.n_vocab == 350
    assert meta["special_tokens"] == {"[PAD]": 346, "[CLS]": 347, "[SEP]": 348, "[MASK]": 349}
    for d in docs:
        n = prepare.normalize(d)
        assert enc.decode(enc.encode_ordinary(n)) == n
    assert prepare.normalize(docs[-1]).startswith("cafe naive facade with [mask] and [sep]")
    ids = enc.encode_ordinary("[MASK] [SEP] [CLS] [PAD] [mask]")
    assert max(ids) < 346  # raw text never turns into a special id
    assert len(enc.encode_ordinary(docs[0])) < len(docs[0]) / 4  # merges were learned


def test_bpe_merges_most_frequent_pair_first():
    ranks = prepare.train_bpe({"ab": 10, "abc": 5, "xy": 3}, 259)
    assert [b for b, r in sorted(ranks.items(), key=lambda x: x[1])][256:] == [b"ab", b"abc", b"xy"]
    assert len(prepare.train_bpe({"ab": 1}, 300)) == 256  # nothing repeats: no merge


def test_deterministic_and_meta(tmp_path):
    docs = make_docs(200) + make_docs(5)  # five exact duplicates
    m1, o1 = prep(str(tmp_path / "a"), docs)
    m2, o2 = prep(str(tmp_path / "b"), docs)
    for f in ("train.bin", "val.bin", "tokenizer.tiktoken"):
        assert open(os.path.join(o1, f), "rb").read() == open(os.path.join(o2, f), "rb").read()
    meta = json.load(open(os.path.join(o1, "meta.json")))
    assert meta["filters"]["duplicates_dropped"] == 5 and meta["filters"]["documents_read"] == 205
    assert meta["documents"] == 200 and meta["seq_len"] == 32 and meta["dtype"] == "uint16"
    for split in ("train", "val"):
        b = open(os.path.join(o1, f"{split}.bin"), "rb").read()
        assert meta[split]["bytes"] == len(b) == meta[split]["rows"] * 32 * 2
        assert meta[split]["sha256"] == __import__("hashlib").sha256(b).hexdigest()
    assert meta["format"] == "cram-data-1" and meta["sources"][0].endswith("data.jsonl")
    assert meta["chars_per_token"] > 3


def test_packing_layout(tmp_path):
    docs = make_docs(300, seed=3)
    meta, out = prep(str(tmp_path), docs)
    enc = prepare.load_tokenizer(prepare.read_prepared(out)[1])
    sep = meta["special_tokens"]["[SEP]"]
    train = np.fromfile(os.path.join(out, "train.bin"), np.uint16)
    val = np.fromfile(os.path.join(out, "val.bin"), np.uint16)
    # documents in order, each followed by [SEP]; whole rows only, the remainder dropped
    stream = [enc.encode_ordinary(prepare.normalize(d)) + [sep] for d in docs]
    val_docs = [i for i in range(len(docs)) if i == 0 or i % prepare.VAL_EVERY == 0]
    flat = lambda ids: np.array([t for i in ids for t in stream[i]], np.uint16)
    want_val, want_train = flat(val_docs), flat(i for i in range(len(docs)) if i not in val_docs)
    assert len(train) == len(want_train) // 32 * 32 and (train == want_train[: len(train)]).all()
    assert len(val) == len(want_val) // 32 * 32 and (val == want_val[: len(val)]).all()
    assert meta["tokens"] == sum(map(len, stream)) - len(docs)


def test_every_input_format(tmp_path):
    docs = make_docs(60, seed=5)
    write_jsonl(str(tmp_path / "a.jsonl"), docs[:20])
    write_jsonl(str(tmp_path / "b.jsonl.gz"), docs[20:30])
    write_jsonl(str(tmp_path / "c.json.gz"), docs[30:40])
    (tmp_path / "d.txt").write_text("\n\n".join(d[:50] + "\n" + d[50:] for d in docs[40:50]) + "\n")
    with gzip.open(tmp_path / "e.txt.gz", "wt") as f:
        f.write("\n\n\n".join(docs[50:]))
    (tmp_path / "ignored.csv").write_text("x")
    meta = prepare.main(["--input", str(tmp_path), "--out", str(tmp_path / "out"), "--vocab-size", "280", "--seq-len", "16", "--trash", "1"])
    assert meta["documents"] == 60 and meta["filters"]["bad_lines"] == 0
    assert [os.path.basename(s) for s in meta["sources"]] == ["a.jsonl", "b.jsonl.gz", "c.json.gz", "d.txt", "e.txt.gz"]


def test_reuse_tokenizer(tmp_path, data):
    meta, out = prep(str(tmp_path), make_docs(50, seed=9), "--tokenizer", data, name="held")
    assert open(os.path.join(out, "tokenizer.tiktoken")).read() == open(os.path.join(data, "tokenizer.tiktoken")).read()
    assert meta["vocab_size"] == 350
    again = prepare.main(["--input", os.path.join(str(tmp_path), "held.jsonl"), "--out", out, "--tokenizer", out,
                          "--vocab-size", "350", "--seq-len", "32", "--trash", "1"])  # into its own folder
    assert again == meta


def test_bad_inputs(tmp_path, capsys):
    out = str(tmp_path / "out")
    run = lambda *inp: prepare.main(["--input", *inp, "--out", out, "--vocab-size", "300", "--seq-len", "32", "--trash", "1"])
    with pytest.raises(SystemExit, match="input not found: .*nope"):
        run(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit, match="no text"):
        run(str(tmp_path / "empty.jsonl"))
    good = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in make_docs(200)).encode())
    (tmp_path / "trunc.jsonl.gz").write_bytes(good[: len(good) // 2])
    with pytest.raises(SystemExit, match="trunc.jsonl.gz: corrupt or truncated"):
        run(str(tmp_path / "trunc.jsonl.gz"))
    (tmp_path / "notgz.jsonl.gz").write_bytes(b"this is not gzip at all\n" * 10)
    with pytest.raises(SystemExit, match="notgz.jsonl.gz: corrupt or truncated"):
        run(str(tmp_path / "notgz.jsonl.gz"))
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "just a few words"}) + "\n")
    with pytest.raises(SystemExit, match="too little data"):
        run(str(tmp_path / "short.jsonl"))
    assert not any(f.endswith((".bin", ".json", ".tmp")) for f in os.listdir(out))  # nothing that looks complete
    # single bad lines are skipped and counted
    lines = [json.dumps({"text": d}).encode() for d in make_docs(200)]
    lines[3], lines[7], lines[9] = b'{"title": "no text field"}', b'{"text": "bad \xff\xfe utf8"}', b"{broken json"
    (tmp_path / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    meta = run(str(tmp_path / "mixed.jsonl"))
    assert meta["filters"]["bad_lines"] == 3 and meta["documents"] == 197
    assert "mixed.jsonl:4: skipped" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--vocab-size 70000"):
        prepare.main(["--input", str(tmp_path / "mixed.jsonl"), "--vocab-size", "70000"])


def test_trash_filter(tmp_path):
    docs = make_docs(100) + ["".join(map(chr, np.random.default_rng(1).integers(0x4e00, 0x9fff, 3000)))]
    meta, _ = prep(str(tmp_path), docs, "--trash", "0.8")
    assert meta["filters"]["trash_dropped"] == 1 and meta["filters"]["trash_chars_dropped"] == 3000


def test_download(tmp_path, http_server):
    url, h = http_server
    body = os.urandom(3_000_000)
    h.FILES["/f.bin"] = body
    path = str(tmp_path / "f.bin")
    assert prepare.download(url + "/f.bin", path) == path and open(path, "rb").read() == body
    n = len(h.hits)
    prepare.download(url + "/f.bin", path)  # complete: not fetched again
    assert len(h.hits) == n
    # resume a partial .part with a Range request
    path2 = str(tmp_path / "g.bin")
    open(path2 + ".part", "wb").write(body[:1_000_000])
    prepare.download(url + "/f.bin", path2)
    assert open(path2, "rb").read() == body and h.hits[-1][1] == "bytes=1000000-"
    # a transfer cut short is resumed on the next attempt
    h.FILES["/cut.bin"], h.BROKEN = body, {"/cut.bin"}
    with pytest.raises(SystemExit, match=r"download failed: .*/cut.bin"):
        prepare.download(url + "/cut.bin", str(tmp_path / "cut.bin"))
    assert not os.path.exists(tmp_path / "cut.bin")  # only the .part, never a complete-looking file
    assert [r for p, r in h.hits if p == "/cut.bin"][1] is not None  # retries resumed
    h.BROKEN.clear()
    prepare.download(url + "/cut.bin", str(tmp_path / "cut.bin"))
    assert open(tmp_path / "cut.bin", "rb").read() == body
    with pytest.raises(SystemExit, match=r"download failed: .*/missing.*HTTP 404"):
        prepare.download(url + "/missing", str(tmp_path / "m"))
    assert not os.path.exists(tmp_path / "m") and len([p for p, _ in h.hits if p == "/missing"]) == 1  # no retry
    h.FILES["/busy"] = 500
    with pytest.raises(SystemExit, match=r"download failed: .*/busy.*HTTP 500"):
        prepare.download(url + "/busy", str(tmp_path / "b"))
    assert len([p for p, _ in h.hits if p == "/busy"]) == prepare.RETRIES  # server errors are retried


def test_c4_download_path(tmp_path, http_server, monkeypatch):
    url, h = http_server
    for i in range(2):
        h.FILES[f"/c4-{i}.json.gz"] = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in make_docs(100, i)).encode())
    monkeypatch.setattr(prepare, "C4_URL", url + "/c4-{i}.json.gz")
    meta = prepare.main(["--shards", "2", "--out", str(tmp_path), "--vocab-size", "300", "--seq-len", "32", "--trash", "1"])
    assert meta["documents"] == 200 and len(meta["sources"]) == 2
    with pytest.raises(SystemExit, match="c4-2.json.gz: HTTP 404"):
        prepare.main(["--shards", "3", "--out", str(tmp_path), "--vocab-size", "300"])


