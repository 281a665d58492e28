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


def naive_bpe(counts, n_vocab):
    """The textbook algorithm, for comparison: count all pairs, merge the best, repeat."""
    words, vocab = {tuple(w.encode()): c for w, c in counts.items()}, [bytes([b]) for b in range(256)]
    while len(vocab) < n_vocab:
        pairs = {}
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] = pairs.get(p, 0) + c
        if not pairs or max(pairs.values()) < 2:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        vocab.append(vocab[best[0]] + vocab[best[1]])
        merged = {}
        for w, c in words.items():
            out, j = [], 0
            while j < len(w):
                if w[j:j + 2] == best:
                    out.append(len(vocab) - 1)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + c
        words = merged
    return {b: i for i, b in enumerate(vocab)}


def test_bpe_matches_the_textbook_algorithm():
    rng = random.Random(4)
    counts = {"".join(rng.choice("aab c") for _ in range(rng.randint(1, 9))): rng.randint(1, 30) for _ in range(300)}
    counts["aaaaaaa"] = 50  # overlapping pairs
    assert list(prepare.train_bpe(counts, 330).items()) == list(naive_bpe(counts, 330).items())


def test_workers_give_identical_output(tmp_path, monkeypatch):
    docs = make_docs(300, seed=7) + make_docs(20, seed=7)  # 20 duplicates
    lines = [json.dumps({"text": d}) for d in docs]
    lines[5], lines[50] = '{"text": null}', "{broken"
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    metas = []
    for workers, task_bytes in (("1", 3000), ("3", 3000), ("2", 1 << 20)):  # many tasks, or one
        monkeypatch.setattr(prepare, "TASK_BYTES", task_bytes)
        metas.append(prepare.main(["--input", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / workers),
                                   "--vocab-size", "300", "--seq-len", "16", "--workers", workers, "--sample-mb", "0.02"]))
        assert metas[-1]["filters"]["bad_lines"] == 2 and metas[-1]["filters"]["duplicates_dropped"] == 19  # doc 5 was replaced
    assert metas[0] == metas[1] == metas[2]
    for f in ("train.bin", "val.bin", "tokenizer.tiktoken", "meta.json"):
        assert (tmp_path / "1" / f).read_bytes() == (tmp_path / "3" / f).read_bytes() == (tmp_path / "2" / f).read_bytes()


def test_failed_rerun_keeps_the_old_folder(tmp_path):
    meta, out = prep(str(tmp_path), make_docs(200))
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "a few words"}) + "\n")
    args = ["--out", out, "--vocab-size", "300", "--seq-len", "32"]
    with pytest.raises(SystemExit, match="too little data"):
        prepare.main(["--input", str(tmp_path / "short.jsonl"), *args])
    with pytest.raises(SystemExit, match="input not found"):
        prepare.main(["--input", str(tmp_path / "nope.jsonl"), *args])
    bad_tok = str(tmp_path / "badtok")
    os.makedirs(bad_tok)
    for f in ("meta.json", "train.bin", "val.bin"):
        open(os.path.join(bad_tok, f), "wb").write(before[f])
    open(os.path.join(bad_tok, "tokenizer.tiktoken"), "w").write("not base64 at all\n!!\n")
    with pytest.raises(SystemExit, match="badtok/tokenizer.tiktoken: .*unreadable"):
        prepare.main(["--input", str(tmp_path / "data.jsonl"), "--tokenizer", bad_tok, *args])
    short = "".join(before["tokenizer.tiktoken"].decode().splitlines(keepends=True)[:300])  # readable, too few
    open(os.path.join(bad_tok, "tokenizer.tiktoken"), "w").write(short)
    with pytest.raises(SystemExit, match="badtok/tokenizer.tiktoken: 304 tokens, but meta.json says 350"):
        prepare.main(["--input", str(tmp_path / "data.jsonl"), "--tokenizer", bad_tok, *args])
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == before  # nothing lost, no .tmp
    assert prepare.read_prepared(out)[0] == meta


def test_trash_filter_scales_with_the_vocabulary(tmp_path, capsys):
    rng = np.random.default_rng(2)
    cjk = ["".join(map(chr, rng.integers(0x4e00, 0x9fff, 300))) for _ in range(20)]
    write_jsonl(str(tmp_path / "en.jsonl"), make_docs(300))
    for vocab in ("261", "2048"):  # at 261 English has ~0.8 tokens/char: a fixed 0.3 would drop it all
        meta = prepare.main(["--input", str(tmp_path / "en.jsonl"), "--out", str(tmp_path / vocab),
                             "--vocab-size", vocab, "--seq-len", "16"])
        assert meta["documents"] == 300 and meta["filters"]["trash_dropped"] == 0
    assert meta["sample_tokens_per_char"] < 0.3 < prepare.read_prepared(str(tmp_path / "261"))[0]["sample_tokens_per_char"]
    assert "--trash" not in capsys.readouterr().err
    write_jsonl(str(tmp_path / "mixed.jsonl"), make_docs(80) + cjk)
    meta = prepare.main(["--input", str(tmp_path / "mixed.jsonl"), "--out", str(tmp_path / "m"),
                         "--vocab-size", "261", "--seq-len", "16"])
    assert meta["documents"] == 80 and meta["filters"]["trash_dropped"] == 20
    err = capsys.readouterr().err
    assert "WARNING: the trash filter dropped" in err and "raise --trash" in err


def test_text_that_is_not_a_string_is_a_bad_line(tmp_path, capsys):
    lines = [json.dumps({"text": d}) for d in make_docs(100)]
    lines[1:1] = ['{"text": null}', '{"text": 12}', '{"text": ["a", "b"]}', '{"title": "x"}', "[1, 2]", '"just a string"']
    (tmp_path / "odd.jsonl").write_text("\n".join(lines) + "\n")
    meta = prepare.main(["--input", str(tmp_path / "odd.jsonl"), "--out", str(tmp_path / "o"), "--vocab-size", "300",
                         "--seq-len", "16", "--workers", "2"])
    assert meta["filters"]["bad_lines"] == 6 and meta["documents"] == 100
    err = capsys.readouterr().err
    assert "odd.jsonl:2: skipped" in err and "odd.jsonl:3: skipped" in err and "Traceback" not in err


def test_download_retries_are_said(tmp_path, http_server, capsys):
    url, h = http_server
    h.FILES["/busy"] = 503
    with pytest.raises(SystemExit, match=r"download failed: .*/busy: HTTP 503"):
        prepare.download(url + "/busy", str(tmp_path / "b"))
    retries = [l for l in capsys.readouterr().err.splitlines() if "/busy" in l]
    assert len(retries) == prepare.RETRIES - 1
    assert "HTTP 503 (attempt 1 of 5); waiting 0.01s" in retries[0] and "attempt 4 of 5" in retries[-1]


@pytest.mark.parametrize("flag,value", [("--vocab-size", "260"), ("--vocab-size", "70000"), ("--seq-len", "1"),
                                        ("--trash", "0"), ("--sample-mb", "-1"), ("--shards", "0"),
                                        ("--shards", "1025"), ("--tokens", "0"), ("--workers", "0")])
def test_out_of_range_flags(tmp_path, flag, value):
    with pytest.raises(SystemExit, match=f"error: {flag} {value}: must be in .*\\.\\."):
        prepare.main([flag, value, "--out", str(tmp_path / "o")])
    assert not os.path.exists(tmp_path / "o")  # checked before any work


def test_flags_that_do_not_go_together(tmp_path):
    with pytest.raises(SystemExit, match="not with --input"):
        prepare.main(["--input", "x.jsonl", "--tokens", "1e9", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="not both"):
        prepare.main(["--shards", "3", "--tokens", "1e9", "--out", str(tmp_path)])


def c4_shards(h, n):
    for i in range(n):
        h.FILES[f"/c4-{i}.json.gz"] = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in make_docs(100, i)).encode())


def test_tokens_picks_the_number_of_shards(tmp_path, http_server, monkeypatch, capsys):
    url, h = http_server
    c4_shards(h, 5)
    monkeypatch.setattr(prepare, "C4_URL", url + "/c4-{i}.json.gz")
    args = ["--vocab-size", "300", "--seq-len", "32", "--sample-mb", "0.01", "--workers", "1"]  # reads at most one task ahead
    one = prepare.main(["--shards", "1", "--out", str(tmp_path / "a"), *args])
    h.hits.clear()
    meta = prepare.main(["--tokens", str(2.5 * one["tokens"]), "--out", str(tmp_path / "b"), *args])
    assert [os.path.basename(s) for s in meta["sources"]] == [f"c4-train.0000{i}.json.gz" for i in range(3)]
    assert meta["documents"] == 300 and meta["tokens"] > 2.5 * one["tokens"] * 0.9
    assert sorted(p for p, _ in h.hits) == [f"/c4-{i}.json.gz" for i in range(3)]  # never more than needed
    assert "so 3 shards" in capsys.readouterr().err


def test_c4_shards_stream_and_a_restart_resumes(tmp_path, http_server, monkeypatch):
    url, h = http_server
    c4_shards(h, 3)
    noise = os.urandom(200_000).hex()  # large enough that a cut transfer leaves part of it behind
    h.FILES["/c4-2.json.gz"] = gzip.compress((json.dumps({"text": noise}) + "\n").encode()) + h.FILES["/c4-2.json.gz"]
    monkeypatch.setattr(prepare, "C4_URL", url + "/c4-{i}.json.gz")
    h.BROKEN = {"/c4-2.json.gz"}  # a connection that keeps breaking: the run stops
    args = ["--shards", "3", "--out", str(tmp_path), "--vocab-size", "300", "--seq-len", "32", "--workers", "2"]
    with pytest.raises(SystemExit, match="c4-train.00002.json.gz: download failed: .*c4-2.json.gz"):
        prepare.main(args)
    raw = sorted(os.listdir(tmp_path / "raw"))
    assert raw == ["c4-train.00000.json.gz", "c4-train.00001.json.gz", "c4-train.00002.json.gz.part"]
    assert not os.path.exists(tmp_path / "meta.json")
    have = os.path.getsize(tmp_path / "raw/c4-train.00002.json.gz.part")
    h.BROKEN, h.hits[:] = set(), []
    meta = prepare.main(args)  # started again: shards 0 and 1 are not fetched again, 2 resumes
    assert have > 0 and h.hits == [("/c4-2.json.gz", f"bytes={have}-")]
    assert meta["documents"] == 301 and len(meta["sources"]) == 3
