"""Tests for prepare.py, cram.py and glue.py: no network, tiny data made here; CUDA cases run where there is a GPU."""
import argparse, base64, builtins, contextlib, gzip, http.server, io, json, math, os, random, shutil, signal, socket, stat, subprocess, sys, threading, time, zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import numpy as np
import pytest
import torch

import cram
import glue
import prepare
from cram import Crammed, ModelConfig

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = ("the a cat dog sat on mat ran far away over hill under tree king queen said that it was "
         "very good bad day night old new house river stone green red blue small large").split()


def make_docs(n, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))) + "." for _ in range(n)]


def write_jsonl(path, docs):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return str(path)


def prep(tmp, docs=None, *extra, name="data"):
    src = write_jsonl(os.path.join(tmp, f"{name}.jsonl"), docs or make_docs(200))
    out = os.path.join(tmp, name)
    return prepare.main(["--input", src, "--out", out, "--vocab-size", "350", "--seq-len", "32", "--trash", "1", *extra]), out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prep(str(tmp_path_factory.mktemp("data")))[1]


def data_file(out, kind):
    """The path of a prepared folder's train, val or tokenizer file."""
    return os.path.join(out, "tokenizer.tiktoken" if kind == "tokenizer" else kind + ".bin")


def folder_bytes(out):
    return {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out) if os.path.isfile(os.path.join(out, f))}


# ----------------------------------------------------------------------------- a loopback server
class Handler(http.server.BaseHTTPRequestHandler):
    """Serves FILES (bytes, or an HTTP status); paths in BROKEN send half the body and hang up."""
    FILES, BROKEN, hits = {}, set(), []

    def do_GET(self):
        self.hits.append(self.path)
        body = self.FILES.get(self.path)
        if not isinstance(body, bytes):
            self.send_error(body or 404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path in self.BROKEN:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def http_server(monkeypatch):
    monkeypatch.setattr(prepare, "BACKOFF", 0.01)
    Handler.FILES.clear(), Handler.BROKEN.clear(), Handler.hits.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", Handler
    server.shutdown()



@pytest.fixture
def one_thread():  # tiny models on a shared CPU: a second thread only adds contention
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
    assert prepare.normalize(docs[-1]).endswith("unicode 123_456 ok")  # v2: no non-ASCII at all
    assert prepare.normalize("\u201cdon\u2019t\u201d \u2014 caf\u00e9 \U0001F600!") == "dont cafe !"
    ids = enc.encode_ordinary("[MASK] [SEP] [CLS] [PAD] [mask]")
    assert max(ids) < 346  # raw text never turns into a special id
    assert len(enc.encode_ordinary(docs[0])) < len(docs[0]) / 4  # merges were learned


def test_bpe_merges_most_frequent_pair_first():
    vocab = prepare.train_bpe({"ab": 10, "abc": 5, "xy": 3}, 259)
    assert [b for b, i in sorted(vocab.items(), key=lambda x: x[1])][256:] == [b"ab", b"abc", b"xy"]
    assert len(prepare.train_bpe({"ab": 1}, 300)) == 256  # nothing repeats: no merge


def test_deterministic_and_meta(tmp_path):
    docs = make_docs(200) + make_docs(5)  # five exact duplicates
    m1, o1 = prep(str(tmp_path / "a"), docs)
    m2, o2 = prep(str(tmp_path / "b"), docs)
    meta = json.load(open(os.path.join(o1, "meta.json")))
    del m1["sources"], m2["sources"], meta["sources"]
    assert m1 == m2 == meta
    one, two = folder_bytes(o1), folder_bytes(o2)
    del one["meta.json"], two["meta.json"]
    assert one == two  # the same names, the same bytes
    assert meta["filters"]["duplicates"] == 5
    assert meta["documents"] == 200 and meta["seq_len"] == 32
    for split in ("train", "val"):
        assert os.path.getsize(data_file(o1, split)) == meta[split]["rows"] * 32 * 2
    assert sorted(os.listdir(o1)) == ["meta.json", "tokenizer.tiktoken", "train.bin", "val.bin"]
    assert meta["characters"] / meta["tokens"] > 3


def test_packing_layout(tmp_path):
    docs = make_docs(300, seed=3)
    meta, out = prep(str(tmp_path), docs)
    enc = prepare.load_tokenizer(prepare.read_prepared(out)[1])
    sep = meta["special_tokens"]["[SEP]"]
    train = np.fromfile(data_file(out, "train"), np.uint16)
    val = np.fromfile(data_file(out, "val"), np.uint16)
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
    inputs = [str(tmp_path / f) for f in ("a.jsonl", "b.jsonl.gz", "c.json.gz", "d.txt", "e.txt.gz")]
    meta = prepare.main(["--input", *inputs, "--out", str(tmp_path / "out"), "--vocab-size", "280", "--seq-len", "16", "--trash", "1"])
    assert meta["documents"] == 60 and meta["filters"]["bad_lines"] == 0
    assert [os.path.basename(s) for s in meta["sources"]] == ["a.jsonl", "b.jsonl.gz", "c.json.gz", "d.txt", "e.txt.gz"]


def test_bad_inputs(tmp_path):
    out = str(tmp_path / "out")
    run = lambda *inp: prepare.main(["--input", *inp, "--out", out, "--vocab-size", "300", "--seq-len", "32", "--trash", "2"])
    with pytest.raises(SystemExit, match="nope.jsonl: No such file or directory"):
        run(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit, match="too little data"):
        run(str(tmp_path / "empty.jsonl"))
    good = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in make_docs(200)).encode())
    (tmp_path / "trunc.jsonl.gz").write_bytes(good[: len(good) // 2])
    with pytest.raises(SystemExit, match=r"trunc.jsonl.gz: damaged or unreadable \(EOFError: .*\)$"):  # the user's file: kept
        run(str(tmp_path / "trunc.jsonl.gz"))
    (tmp_path / "notgz.jsonl.gz").write_bytes(b"this is not gzip at all\n" * 10)
    with pytest.raises(SystemExit, match=r"notgz.jsonl.gz: damaged or unreadable \(BadGzipFile: .*\)$"):
        run(str(tmp_path / "notgz.jsonl.gz"))
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "just a few words"}) + "\n")
    with pytest.raises(SystemExit, match="too little data"):
        run(str(tmp_path / "short.jsonl"))
    assert "meta.json" not in os.listdir(out)  # nothing that looks complete
    # single bad lines are skipped and counted
    lines = [json.dumps({"text": d}).encode() for d in make_docs(200)]
    lines[3], lines[7], lines[9] = b'{"title": "no text field"}', b'{"text": "bad \xff\xfe utf8"}', b"{broken json"
    (tmp_path / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    meta = run(str(tmp_path / "mixed.jsonl"))
    assert meta["filters"]["bad_lines"] == 3 and meta["documents"] == 197


def test_an_unreadable_input_is_not_a_write_error(tmp_path, monkeypatch):
    src = write_jsonl(str(tmp_path / "a.jsonl"), make_docs(50))
    real_open = open
    def fake_open(path, *a, **k):
        if path == src:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *a, **k)
    monkeypatch.setattr(prepare, "open", fake_open, raising=False)
    with pytest.raises(SystemExit, match=f"^error: {src}: Permission denied$"):
        prepare.main(["--input", src, "--out", str(tmp_path / "o"), "--vocab-size", "300"])
    assert os.listdir(tmp_path / "o") == []


def test_trash_filter(tmp_path, capsys):
    junk = "".join(map(chr, np.random.default_rng(1).integers(0x21, 0x7f, 3000)))  # no spaces
    docs = make_docs(100) + [junk]
    meta, out = prep(str(tmp_path), docs, "--trash", "0.8")
    assert meta["filters"]["trash"] == 1 and meta["filters"]["trash_chars"] == 3000
    assert '"trash": 1, "trash_chars": 3000}\n' in capsys.readouterr().out
    meta, _ = prep(str(tmp_path), docs, "--trash", "0", name="none")  # 0: no filter, not the default
    assert meta["documents"] == 101 and meta["trash"] == 0 and meta["filters"]["trash"] == 0
    _, out = prep(str(tmp_path), docs[:100], "--trash", "0", name="all100")  # its tokenizer: the same
    enc, texts = prepare.load_tokenizer(prepare.read_prepared(out)[1]), [prepare.normalize(d) for d in docs[:100]]
    ratios = sorted(len(enc.encode_ordinary(t)) / len(t) for t in texts)
    trash = (ratios[49] + ratios[50]) / 2  # the paper's rule: a document stays if tokens < trash x characters
    meta, _ = prep(str(tmp_path), docs[:100], "--trash", repr(trash), name="half")  # learns that tokenizer again
    assert meta["documents"] == 50 and meta["filters"]["trash"] == 50
    with pytest.raises(SystemExit, match=r"too little data .*; give more text, or raise --trash 0.01 if its 101 dropped documents are text$"):
        prep(str(tmp_path), docs, "--trash", "0.01", name="all")


def test_download(tmp_path, http_server):
    url, h = http_server
    body = os.urandom(3_000_000)
    h.FILES["/f.bin"] = body
    path = str(tmp_path / "f.bin")
    assert prepare.download(url + "/f.bin", path) == path and open(path, "rb").read() == body
    prepare.download(url + "/f.bin", path)  # complete: not fetched again
    assert h.hits == ["/f.bin"]
    # a transfer cut short starts again from zero, and never leaves a complete-looking file
    h.FILES["/cut.bin"], h.BROKEN = body, {"/cut.bin"}
    with pytest.raises(SystemExit, match=r"download failed: .*/cut.bin"):
        prepare.download(url + "/cut.bin", str(tmp_path / "cut.bin"))
    assert sorted(os.listdir(tmp_path)) == ["cut.bin.part", "f.bin"] and h.hits.count("/cut.bin") == prepare.RETRIES
    h.BROKEN.clear()
    prepare.download(url + "/cut.bin", str(tmp_path / "cut.bin"))
    assert open(tmp_path / "cut.bin", "rb").read() == body
    with pytest.raises(SystemExit, match=r"download failed: .*/missing.*HTTP 404"):
        prepare.download(url + "/missing", str(tmp_path / "m"))
    assert not os.path.exists(tmp_path / "m") and h.hits.count("/missing") == prepare.RETRIES  # every failure
    h.FILES["/busy"] = 500
    with pytest.raises(SystemExit, match=r"download failed: .*/busy.*HTTP 500"):
        prepare.download(url + "/busy", str(tmp_path / "b"))
    assert h.hits.count("/busy") == prepare.RETRIES


def c4_shards(h, n):
    for i in range(n):
        h.FILES[f"/c4-{i}.json.gz"] = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in make_docs(100, i)).encode())


def test_c4_shards_download_and_a_restart_fetches_only_what_is_missing(tmp_path, http_server, monkeypatch):
    url, h = http_server
    c4_shards(h, 3)
    monkeypatch.setattr(prepare, "C4_URL", url + "/c4-{i}.json.gz")
    h.BROKEN = {"/c4-2.json.gz"}  # a connection that keeps breaking: the run stops
    args = ["--shards", "3", "--out", str(tmp_path), "--vocab-size", "300", "--seq-len", "32", "--workers", "2", "--trash", "1"]
    with pytest.raises(SystemExit, match="download failed: .*c4-2.json.gz"):
        prepare.main(args)
    assert sorted(os.listdir(tmp_path / "raw"))[:2] == ["c4-train.00000.json.gz", "c4-train.00001.json.gz"]
    assert sorted(os.listdir(tmp_path)) == ["raw"]  # nothing but the shards so far
    h.BROKEN, h.hits[:] = set(), []
    pool, raw = prepare.multiprocessing.Pool, []  # the shards on the disk when the workers start
    monkeypatch.setattr(prepare.multiprocessing, "Pool", lambda *a: raw.append(sorted(os.listdir(tmp_path / "raw"))) or pool(*a))
    meta = prepare.main(args)  # started again: shards 0 and 1 are not fetched again
    assert h.hits == ["/c4-2.json.gz"] and meta["documents"] == 300
    assert raw == [[f"c4-train.0000{i}.json.gz" for i in range(3)]]  # all downloaded before the pool
    assert meta["sources"] == [url + f"/c4-{i}.json.gz" for i in range(3)]
    with pytest.raises(SystemExit, match="c4-3.json.gz: HTTP 404"):
        prepare.main([*args, "--shards", "4", "--out", str(tmp_path / "four")])
    assert prepare.read_prepared(str(tmp_path))[0] == meta


def test_a_corrupt_downloaded_shard_is_named_with_what_to_do(tmp_path, http_server, monkeypatch):
    url, h = http_server
    c4_shards(h, 1)
    monkeypatch.setattr(prepare, "C4_URL", url + "/c4-{i}.json.gz")
    shard = tmp_path / "raw" / "c4-train.00000.json.gz"
    shard.parent.mkdir()
    damaged = bytearray(h.FILES["/c4-0.json.gz"])
    damaged[len(damaged) // 2] ^= 0xFF  # complete, but a byte damaged on the disk
    shard.write_bytes(damaged)
    args = ["--shards", "1", "--out", str(tmp_path), "--vocab-size", "300", "--seq-len", "32", "--trash", "1"]
    with pytest.raises(SystemExit, match=f"^error: {shard}: damaged or unreadable .*; delete it and run again: it is downloaded again$"):
        prepare.main(args)
    assert h.hits == []  # it was there, so it was read
    shard.unlink()  # as the message says
    assert prepare.main(args)["documents"] == 100 and h.hits == ["/c4-0.json.gz"]


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
    monkeypatch.setattr(prepare, "JOB_BYTES", 3000)  # many jobs; the tokenizer sees the first 7
    for workers in ("1", "3", "2"):
        metas.append(prepare.main(["--input", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / workers),
                                   "--vocab-size", "300", "--seq-len", "16", "--workers", workers, "--sample-mb", "0.02", "--trash", "1"]))
        assert metas[-1]["filters"]["bad_lines"] == 2 and metas[-1]["filters"]["duplicates"] == 19  # doc 5 was replaced
    assert metas[0] == metas[1] == metas[2]
    assert folder_bytes(tmp_path / "1") == folder_bytes(tmp_path / "3") == folder_bytes(tmp_path / "2")


def test_atomic_cleans_up_after_any_writer_and_syncs_the_folder(tmp_path, monkeypatch):
    path = str(tmp_path / "f.json")
    with prepare.atomic(path, "w") as f:
        f.write("old")
    with pytest.raises(OSError):
        with prepare.atomic(path, "w") as f:
            f.write("half")
            raise OSError(28, "No space left on device")
    assert open(path).read() == "old" and os.listdir(tmp_path) == ["f.json"]
    with pytest.raises(OSError) as e:  # the error names the file, which the disk's own does not
        with prepare.atomic(path, "w") as f:
            raise OSError(28, "No space left on device")
    assert e.value.filename == path
    synced, fsync = [], os.fsync
    monkeypatch.setattr(prepare.os, "fsync", lambda fd: synced.append(os.fstat(fd).st_mode) or fsync(fd))
    with prepare.atomic(path) as f:
        f.write(b"new")
    assert open(path).read() == "new" and [stat.S_ISDIR(m) for m in synced] == [False, True]


def test_prepared_data_is_never_overwritten(tmp_path):
    meta, out = prep(str(tmp_path), make_docs(200))
    before = folder_bytes(out)
    with pytest.raises(SystemExit, match="--out .*data holds prepared data \\(meta.json\\)"):
        prep(str(tmp_path), make_docs(150, seed=1))
    assert folder_bytes(out) == before and prepare.read_prepared(out)[0] == meta


@pytest.mark.parametrize("where", ["train_bpe", "replace"])
def test_an_interrupted_run_leaves_no_meta_json(tmp_path, monkeypatch, capsys, where):
    def interrupted(*a, **k):  # Ctrl-C while the tokenizer trains, or at the last step, the rename
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare if where == "train_bpe" else os, where, interrupted)
    with pytest.raises(SystemExit) as e:
        prep(str(tmp_path), make_docs(150, seed=1))
    assert e.value.code == 130 and capsys.readouterr().err.strip().endswith("error: interrupted")
    monkeypatch.undo()
    assert not os.path.exists(tmp_path / "data" / "meta.json")  # not data, and cram.py says so
    with pytest.raises(SystemExit, match="data: no prepared data \\(no meta.json\\)"):
        cram.main(["--data", str(tmp_path / "data"), "--out", str(tmp_path / "o"), *TINY])
    assert prep(str(tmp_path), make_docs(150, seed=1))[0]["documents"] == 150  # run again: it completes


def test_read_prepared_names_a_missing_or_damaged_file(tmp_path, data):
    def damaged(name, content):
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(data, bad)
        if content is None:
            os.remove(bad / name)
        else:
            (bad / name).write_bytes(content)
        return str(bad)
    meta = prepare.read_prepared(data)[0]
    cases = [  # (file, its new content or None: removed, what the one line says)
        *[("meta.json", json.dumps({k: v for k, v in meta.items() if k != key}).encode(), r"meta.json: .*KeyError: '" + key)
          for key in ("train", "vocab_size", "seq_len")],  # blamed on meta.json, not the file its key is about
        ("meta.json", json.dumps({**meta, "seq_len": "32"}).encode(), r"meta.json: .*TypeError"),
        ("meta.json", b"{not json", r"meta.json: .*JSONDecodeError"),
        ("tokenizer.tiktoken", b"not base64 at all\n!!\n", r"tokenizer.tiktoken: .*ValueError"),
        ("tokenizer.tiktoken", None, r"tokenizer.tiktoken: .*FileNotFoundError"),
        ("val.bin", b"\0" * 64 * (meta["val"]["rows"] + 1), r"val.bin: .* rows, meta.json says"),
        ("val.bin", b"\0" * 100, r"val.bin: .*ValueError"),
        ("train.bin", None, r"train.bin: .*FileNotFoundError")]
    for name, content, says in cases:
        with pytest.raises(SystemExit, match=f"^error: .*bad/{says}.*; prepare the data again into another --out, or remove .*bad first$"):
            prepare.read_prepared(damaged(name, content))
    with pytest.raises(SystemExit, match="none: no prepared data .*run prepare.py"):
        prepare.read_prepared(str(tmp_path / "none"))


def test_text_that_is_not_a_string_is_a_bad_line(tmp_path, capsys):
    lines = [json.dumps({"text": d}) for d in make_docs(100)]
    lines[1:1] = ['{"text": null}', '{"text": 12}', '{"text": ["a", "b"]}', '{"title": "x"}', "[1, 2]", '"just a string"', '{"text": " \\n "}']
    (tmp_path / "odd.jsonl").write_text("\n".join(lines) + "\n")
    meta = prepare.main(["--input", str(tmp_path / "odd.jsonl"), "--out", str(tmp_path / "o"), "--vocab-size", "300",
                         "--seq-len", "16", "--workers", "2", "--trash", "1"])
    assert meta["filters"]["bad_lines"] == 7 and meta["documents"] == 100
    assert "Traceback" not in capsys.readouterr().err


def test_download_retries_are_said(tmp_path, http_server, capsys):
    url, h = http_server
    h.FILES["/busy"] = 503
    with pytest.raises(SystemExit, match=r"download failed: .*/busy: HTTP 503"):
        prepare.download(url + "/busy", str(tmp_path / "b"))
    retries = [l for l in capsys.readouterr().err.splitlines() if "/busy" in l]
    assert len(retries) == prepare.RETRIES - 1
    assert "HTTP 503 (attempt 1 of 5); waiting 0.01s" in retries[0] and "attempt 4 of 5" in retries[-1]
    with socket.socket() as s:  # a port where nothing listens: one short line, not urllib3's story
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/x"
    with pytest.raises(SystemExit, match=f"^error: download failed: {closed}: connection failed$"):
        prepare.download(closed, str(tmp_path / "x"))


def test_the_papers_defaults():
    args = prepare.get_args([])
    assert (args.vocab_size, args.seq_len, args.trash, args.sample_mb, args.shards) == (32768, 128, 0.3, 100, 33)


@pytest.mark.parametrize("flag, value, says", [
    ("--shards", "0", "0 is not a finite number above 0"), ("--shards", "-2", "-2 is not"), ("--workers", "0", "0 is not"),
    ("--seq-len", "0", "0 is not"), ("--sample-mb", "0", "0.0 is not"), ("--sample-mb", "nan", "nan is not"),
    ("--vocab-size", "259", "259 is not from 260"), ("--vocab-size", "70000", "(ids are stored as uint16)"),
    ("--trash", "-1", "-1.0 is not 0 or a finite number above 0"), ("--trash", "nan", "nan is not 0 or"),
    ("--shards", "1025", "1025 is not a finite number above 0, at most 1024")])
def test_a_value_that_cannot_work_is_argparses_one_line(tmp_path, capsys, flag, value, says):
    with pytest.raises(SystemExit) as e:  # before any download, worker or folder
        prepare.main([flag, value, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: argument {flag}: " in err and says in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "o")


def test_at_most_two_jobs_per_worker_in_flight(monkeypatch):
    class Pool:  # runs each job when it is collected, and counts those handed out but not collected
        def __init__(self):
            self.out, self.most = 0, 0
        def apply_async(self, fn, args):
            self.out += 1
            self.most = max(self.most, self.out)
            return self
        def get(self):
            self.out -= 1
            return self.out
    monkeypatch.setattr(prepare, "jobs", lambda args: ([i] for i in range(50)))
    pool = Pool()
    assert len(list(prepare.in_order(pool, None, (), argparse.Namespace(workers=3)))) == 50
    assert pool.most == 6 and pool.out == 0


def test_the_eta_waits_for_the_rate_to_settle(monkeypatch, capsys):
    clock = [1000.0]
    monkeypatch.setattr(prepare.time, "time", lambda: clock[0])
    progress = prepare.Progress("SST-2", 1000, "ex")
    clock[0] += 2.5  # a first batch slowed by the warm-up: its rate would say 2:33 left
    progress(16)
    assert capsys.readouterr().err == "SST-2: 16/1,000 ex, 6.4 ex/s\n"
    clock[0] += 3.0  # 5.5 s in: the rate has settled
    progress(600)
    assert capsys.readouterr().err == "SST-2: 600/1,000 ex, ETA 0:03, 109.1 ex/s\n"


# ----------------------------------------------------------------------------- cram.py
TINY = ["--layers", "2", "--width", "64", "--heads", "2", "--ffn", "128", "--micro-batch", "8", "--batch-size", "16",
        "--device", "cpu", "--log-every", "0", "--eval-rows", "64"]


# The GPU path: each test below runs on the CPU everywhere (its twin shows the test works) and on
# CUDA where there is a GPU; on a machine without one the CUDA cases are skipped, with the reason.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def records(out):
    return [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]


def test_parameter_count_and_flops():
    with torch.device("meta"):
        model = cram.Crammed(cram.ModelConfig())
    d, V, L = 768, 32768, 16
    per_layer = 2 * 2 * d + 3 * d * d + d * d + d * 3072 + 1536 * d  # 2 LayerNorms, qkv, proj, gated MLP
    assert sum(p.numel() for p in model.parameters()) == V * d + 1 + 2 * d + L * per_layer + 2 * d == 119_589_889
    assert abs(cram.flops_per_token(cram.ModelConfig()) / 1e9 - 0.62) < 0.01  # the paper's count


SPECIALS_1000 = {"[PAD]": 996, "[CLS]": 997, "[SEP]": 998, "[MASK]": 999}


def test_sparse_prediction_equals_dense_and_initial_loss():
    torch.manual_seed(0)
    c = cram.ModelConfig(vocab_size=1000, seq_len=32, layers=2, width=64, heads=4, ffn=256)
    model = cram.Crammed(c).eval()
    rows = torch.randint(0, 996, (6, 32))
    gen = torch.Generator().manual_seed(0)
    inputs, pos, labels = cram.mask_rows(rows, SPECIALS_1000, gen)
    sparse = model(inputs, positions=pos, labels=labels)
    logits = model(inputs) @ model.emb.weight.T  # decoder on every position, then pick the masked ones
    dense = torch.nn.functional.cross_entropy(logits[torch.arange(6)[:, None], pos].flatten(0, 1), labels.flatten())
    assert torch.allclose(sparse, dense, atol=1e-6)
    assert abs(sparse.item() - math.log(1000)) < 0.1


def test_masking_counts_and_80_10_10():
    specials = torch.tensor([996, 997, 998, 999])
    rows = torch.randint(0, 996, (400, 128))
    rows[:, ::10] = 998  # [SEP]s must never be masked
    gen = torch.Generator().manual_seed(1)
    inputs, pos, labels = cram.mask_rows(rows, SPECIALS_1000, gen)
    assert pos.shape == (400, 32) and all(len(set(p.tolist())) == 32 for p in pos)  # exactly round(0.25 x 128)
    assert (labels == rows.gather(1, pos)).all() and not torch.isin(labels, specials).any()
    got = inputs.gather(1, pos)
    frac_mask, frac_same = (got == 999).float().mean().item(), (got == labels).float().mean().item()
    assert abs(frac_mask - 0.8) < 0.01 and abs(frac_same - 0.1 - 0.1 / 996) < 0.01  # 10% kept, 10% random
    assert (got < 996).logical_or(got == 999).all()  # random replacements are ordinary tokens
    untouched = torch.ones_like(rows, dtype=torch.bool).scatter(1, pos, False)
    assert (inputs[untouched] == rows[untouched]).all()


def test_prepared_rows_always_hold_enough_ordinary_tokens_to_mask(tmp_path):
    """Each [SEP] follows a document of at least one token, so a row holds at least T/2 ordinary
    tokens: never fewer than the T/4 masks, even when every document is one token long."""
    docs = [chr(c) for c in range(33, 127) if chr(c).lower() == chr(c)]  # 68 one-token documents
    meta, out = prep(str(tmp_path), docs, "--trash", "0")
    tok = prepare.read_prepared(out)[2]
    specials = list(meta["special_tokens"].values())
    for split in ("train", "val"):
        rows = torch.from_numpy(tok[split].astype(np.int64))
        ordinary = (~torch.isin(rows, torch.tensor(specials))).sum(1)
        assert ordinary.min() == 16 == rows.shape[1] // 2  # the worst case: one token, one [SEP]
        positions = cram.mask_rows(rows, meta["special_tokens"], torch.Generator().manual_seed(0))[1]
        assert not torch.isin(rows.gather(1, positions), torch.tensor(specials)).any()


def test_schedule_and_ramp():
    assert [cram.schedule(x, 1e-3) for x in (0, 0.25, 0.5, 0.75, 0.9, 1)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 4e-4, 0])
    assert [cram.ramp(x, 8192, 128) for x in (0, 0.01, 0.3, 0.6, 0.9, 1)] == [1, 1, 32, 64, 64, 64]
    assert cram.ramp(0.45, 64, 32) == 2 and cram.ramp(0.1, 64, 32) == 1


def test_overfits_tiny_dataset(tmp_path, data):
    small = tmp_path / "small"
    shutil.copytree(data, small)
    rows = np.fromfile(small / "train.bin", np.uint16)[: 8 * 32]
    rows.tofile(small / "train.bin"), rows.tofile(small / "val.bin")
    meta = json.load(open(small / "meta.json"))
    meta["train"]["rows"] = meta["val"]["rows"] = 8
    json.dump(meta, open(small / "meta.json", "w"))
    cram.main(["--data", str(small), "--out", str(tmp_path / "out"), "--steps", "500", "--lr", "3e-3", *TINY,
               "--batch-size", "8", "--log-every", "1"])
    log = records(str(tmp_path / "out"))
    assert log[0]["loss"] > 5 and log[-1]["val_loss"] < 0.5


def test_budget_is_respected(tmp_path, data):
    t0 = time.time()
    cram.main(["--data", data, "--out", str(tmp_path), "--time", "3", *TINY])
    log = records(str(tmp_path))
    steps = [r for r in log if "lr" in r]  # --log-every 0: one record per step
    assert sum(r["elapsed"] > 3.0 for r in steps) <= 1  # it stops at the first step boundary past the deadline
    assert steps[-1]["elapsed"] >= 2.95 and log[-1]["elapsed"] >= 3.0  # ... and not before it (records round to 0.1 s)
    assert time.time() - t0 < 60 and "val_loss" in log[-1]
    elapsed = cram.load_checkpoint(str(tmp_path / "ckpt.pt"))["elapsed"]  # the time it took, not the budget
    assert elapsed >= 3.0 and round(elapsed, 1) == log[-1]["elapsed"] <= steps[-1]["elapsed"] + 0.1


def test_what_a_newcomer_reads(tmp_path, data, capsys, monkeypatch):
    cram.main(["--data", data, "--out", str(tmp_path / "a"), "--time", "1", *TINY])  # a line a step
    out = capsys.readouterr().out
    assert "step 1 | seqs 8 | tokens 256 | loss" in out and "CPU demo" not in out  # 8 rows of 32
    steps = [r for r in records(str(tmp_path / "a")) if "left" in r]
    assert steps[-1]["elapsed"] >= 0.95 and all(r["left"] >= 0 for r in steps)  # at the end: 0 left
    progress = prepare.Progress("evaluate", 1030, "rows")
    progress(128, force=True)
    assert capsys.readouterr().err.startswith("evaluate: 128/1,030 rows, ")  # counts whole
    prepare.Progress("encode", 105.0, "MB")(52.5, force=True)
    assert capsys.readouterr().err.startswith("encode: 52.5/105.0 MB, ")  # sizes keep a decimal


def test_a_run_of_steps_reports_its_own_time(tmp_path, data, capsys):
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "5", "--time", "0.001", *TINY])
    ckpt, last = cram.load_checkpoint(str(tmp_path / "ckpt.pt")), records(str(tmp_path))[-1]
    assert ckpt["step"] == 5 and ckpt["elapsed"] > 0.001 and last["elapsed"] == round(ckpt["elapsed"], 1)
    assert f"done in {ckpt['elapsed']:.0f}s" in capsys.readouterr().out


def run_cram(*args):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "cram.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("device", DEVICES)
def test_sigterm_checkpoint_and_resume(tmp_path, data, device):
    """On the CPU the resumed run's weights are bit-identical to an uninterrupted run's. On CUDA
    they are close, not equal: some kernels (the embedding's backward adds with atomics, cuBLAS may
    split sums) give other bits from run to run, and 200 steps carry the difference on."""
    common = ["--data", data, "--steps", "200", *TINY, "--device", device, "--no-compile"]
    full = str(tmp_path / "full")
    cram.main([*common, "--out", full])
    part = str(tmp_path / "part")
    p = run_cram(*common, "--out", part)
    while not os.path.exists(os.path.join(part, "log.jsonl")) or len(records(part)) < 20:
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 128 + signal.SIGTERM, out
    assert "signal 15: the run stops at the end of a step and saves" in out  # said at once, then done
    ck = cram.load_checkpoint(os.path.join(part, "ckpt.pt"))
    assert 20 <= ck["step"] < 200
    cram.main([*common, "--out", part, "--resume"])
    a, b = torch.load(os.path.join(full, "ckpt.pt")), torch.load(os.path.join(part, "ckpt.pt"))
    assert b["step"] == a["step"] == 200 and b["data"] == a["data"]
    if device == "cpu":
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert records(full)[-1]["val_loss"] == records(part)[-1]["val_loss"]
    else:
        diff = sum((a["model"][k] - b["model"][k]).norm() ** 2 for k in a["model"]) ** 0.5
        assert diff < 0.02 * sum(v.norm() ** 2 for v in a["model"].values()) ** 0.5
        assert records(part)[-1]["val_loss"] == pytest.approx(records(full)[-1]["val_loss"], rel=0.02)


@pytest.mark.parametrize("device", DEVICES)
def test_training_steps_learn_and_compile_once(tmp_path, data, device):
    """The main job's path: on CUDA torch.compile (one graph: no recompilation after the first
    step), bf16 autocast, fused AdamW, pinned memory with non-blocking copies, TF32."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        cram.main(["--data", data, "--out", str(tmp_path), "--steps", "40", "--lr", "3e-3", *TINY,
                   "--device", device])
    log = records(str(tmp_path))
    steps = [r for r in log if "loss" in r]
    assert len(steps) == 40 and all(math.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 1 and math.isfinite(log[-1]["val_loss"])
    compiled = device == "cuda"  # the first step's line gives the compilation time, not a rate
    assert ("compiled" in steps[0]) == compiled and all("compiled" not in r for r in steps[1:])
    assert all(r["tok_s"] > 0 and r["mfu"] > 0 for r in steps[compiled:])
    assert device == "cpu" or torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("train_on,fill_on", [("cpu", "cpu"), pytest.param("cuda:0", "cpu", marks=CUDA),
                                              pytest.param("cpu", "cuda:0", marks=CUDA)])
def test_a_checkpoint_moves_between_devices(tmp_path, data, train_on, fill_on):
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "30", "--lr", "3e-3", *TINY,
               "--device", train_on, "--no-compile"])
    ckpt = cram.load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert all(t.device.type == "cpu" for t in ckpt["model"].values())  # it loads onto any device
    texts = ["The cat [MASK] on the mat.", "a [MASK] dog [MASK] far"]
    here, there = (cram.main(["--out", str(tmp_path), "--fill", *texts, "--device", d]) for d in ("cpu", fill_on))
    assert [[w for w, _ in a] for a in here] == [[w for w, _ in a] for a in there]
    assert all(p == pytest.approx(q, abs=1e-4) for a, b in zip(here, there) for (_, p), (_, q) in zip(a, b))


WRAPPER = """import faulthandler, os, signal, sys, time
faulthandler.dump_traceback_later(200, exit=True)  # a rank that hangs shows where, then ends
faulthandler.register(signal.SIGUSR1, all_threads=True)  # and where it is, when finished() asks
sys.path.insert(0, {here!r})
import cram
real_save = cram.torch.save
def event(what):  # what each rank did, and when
    open(os.path.join({out!r}, "events"), "a").write(f"{{what}} {{os.environ['RANK']}} {{time.time()}}\\n")
def slow_save(obj, f):  # a checkpoint that takes seconds to write, as 1.4 GB do
    open(os.path.join({out!r}, "saves"), "a").write(os.environ["RANK"])  # who saved, how often
    time.sleep({delay})
    real_save(obj, f)
    event("saved")
cram.torch.save = slow_save
{patch}
try:
    model = cram.main(sys.argv[1:])  # each rank's replica, to compare
finally:
    event("exit")
real_save(model.state_dict(), os.path.join({out!r}, "rank%s.pt" % os.environ["RANK"]))
"""


# torchrun itself, with its stacks on SIGUSR1: a hang outside the ranks shows where too
AGENT = ("import faulthandler, runpy, signal; faulthandler.register(signal.SIGUSR1, all_threads=True); "
         "runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)")


def torchrun(tmp_path, out, *flags, delay=0.0, patch=""):
    script = tmp_path / "wrapper.py"
    script.write_text(WRAPPER.format(here=HERE, delay=delay, out=out, patch=patch))
    return subprocess.Popen([sys.executable, "-c", AGENT, "--standalone", "--nproc_per_node", "2",
                             str(script), "--out", out, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(p, timeout=300):
    """torchrun's output, read while it runs, once it ends. A hang fails the test with every
    process's stacks, then kills them all: torchrun starts its ranks in sessions of their own, so
    a timed-out wait alone would leave them running, and slowing every later test."""
    try:
        return p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        tree = [str(p.pid)] + open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
        for sig in (signal.SIGUSR1, signal.SIGKILL):
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), sig)
                time.sleep(0.5)  # one stack dump at a time
        pytest.fail(f"torchrun ran past {timeout}s; its processes' stacks:\n" + p.communicate()[0])


def replicas_agree(out):
    a, b = (torch.load(os.path.join(out, f"rank{r}.pt")) for r in (0, 1))
    return all(torch.equal(a[k], b[k]) for k in a)


def test_ddp_signal_to_the_workers_waits_for_the_save_and_resumes_exactly(tmp_path, data):
    """torchrun, two gloo processes, accumulation (batch 64 = 4 x 8 x 2): uninterrupted, then
    SIGTERM to the workers during a slow save, then --resume: the same weights, bit for bit."""
    flags = ["--data", data, "--steps", "12", *TINY, "--batch-size", "64"]
    full = str(tmp_path / "full")
    p = torchrun(tmp_path, full, *flags)
    said = finished(p)
    assert p.returncode == 0, said
    assert replicas_agree(full) and records(full)[-2]["seqs"] == sum(16 * cram.ramp(s / 12, 64, 16) for s in range(12))
    part = str(tmp_path / "part")
    p = torchrun(tmp_path, part, *flags, "--save-every", "1e-9", delay=2.0)
    while not os.path.exists(os.path.join(part, "log.jsonl")) or len(records(part)) < 3:
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.05)
    workers = open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
    for pid in workers:  # as a scheduler that signals every process does
        os.kill(int(pid), signal.SIGTERM)
    out = finished(p, 120)
    stopped = [line for line in out.splitlines() if "stopped by signal 15 at step" in line]
    assert stopped and p.returncode != 0, out
    step = cram.load_checkpoint(os.path.join(part, "ckpt.pt"))["step"]
    assert f"at step {step}:" in stopped[0] and 0 < step < 12  # the last step is on the disk
    p = torchrun(tmp_path, part, *flags, "--resume")
    said = finished(p)
    assert p.returncode == 0, said
    a, b = torch.load(os.path.join(full, "ckpt.pt")), torch.load(os.path.join(part, "ckpt.pt"))
    assert a["step"] == b["step"] == 12 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"))])
def test_torchrun_finishes_a_short_run_and_saves_once(tmp_path, data, device):
    """Two processes: over gloo on the CPU, over NCCL with a GPU each (cuda:LOCAL_RANK). The
    default micro-batch keeps the ramp's shape: its first step is 1/8 of the batch, 8 on each."""
    out = str(tmp_path / "run")
    flags = [f for f in TINY if f not in ("--micro-batch", "8")]
    p = torchrun(tmp_path, out, "--data", data, "--steps", "4", *flags, "--batch-size", "128", "--device", device)
    said = finished(p)
    assert p.returncode == 0, said
    assert "micro-batches of 8 x 2, the batch ramps from 16 to 128" in said
    assert [r["batch"] for r in records(out) if "batch" in r] == [16, 16 * cram.ramp(0.25, 128, 16), 16 * cram.ramp(0.5, 128, 16), 128]
    assert replicas_agree(out) and open(os.path.join(out, "saves")).read() == "00"  # rank 0: at the start, the end
    assert cram.load_checkpoint(os.path.join(out, "ckpt.pt"))["step"] == 4


def test_a_hung_torchrun_fails_with_every_stack_and_leaves_nothing_running(tmp_path, data):
    """The guard of the DDP tests: a rank that never returns fails its test within the timeout,
    with the stacks of torchrun and both ranks, and no process of it is left to slow later tests."""
    out = str(tmp_path / "run")
    asleep = f"open(os.path.join({str(tmp_path)!r}, 'asleep' + os.environ['RANK']), 'w').close()"
    p = torchrun(tmp_path, out, "--data", data, "--steps", "2", *TINY, patch=asleep + "\ntime.sleep(3600)")
    while not all(os.path.exists(tmp_path / f"asleep{r}") for r in "01"):  # stacks on call now
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.1)
    ranks = open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
    with pytest.raises(pytest.fail.Exception) as e:
        finished(p, 1)
    said = str(e.value)
    assert "ran past 1s" in said and said.count("wrapper.py") >= 2  # each rank's stack, in its sleep
    assert "torch/distributed" in said  # the agent's own stack
    time.sleep(1)
    for pid in [p.pid, *ranks]:  # gone, or a zombie that no longer runs
        with contextlib.suppress(FileNotFoundError):
            assert open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid


NAN_ON_RANK_1 = """real_ce, calls = cram.F.cross_entropy, []
def nan_in_step_3(*a, **k):  # rank 1's third loss: the all-reduce brings its gradient to rank 0
    calls.append(1)
    nan = len(calls) == 3 and os.environ["RANK"] == "1"
    return real_ce(*a, **k) * (float("nan") if nan else 1.0)
cram.F.cross_entropy = nan_in_step_3"""


def test_ddp_a_non_finite_gradient_saves_before_any_rank_leaves(tmp_path, data):
    """Every rank sees the all-reduced gradient's norm; none leaves (and lets torchrun end rank 0)
    before rank 0's slow checkpoint of the last good step is on the disk."""
    out = str(tmp_path / "run")
    p = torchrun(tmp_path, out, "--data", data, "--steps", "6", *TINY, delay=2.0, patch=NAN_ON_RANK_1)
    said = finished(p)
    assert p.returncode != 0 and f"error: gradient not finite at step 3; {out}/ckpt.pt holds step 2" in said
    events = [line.split() for line in open(os.path.join(out, "events")).read().splitlines()]
    saved = [float(t) for what, rank, t in events if what == "saved"]
    exits = [float(t) for what, rank, t in events if what == "exit"]
    assert len(saved) == 2 and len(exits) == 2 and min(exits) >= saved[1], events  # at the start, at the fault
    assert cram.load_checkpoint(os.path.join(out, "ckpt.pt"))["step"] == 2


def test_ranks_wait_an_hour_for_rank_0_not_nccls_ten_minutes(monkeypatch):
    seen = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(cram.dist, "init_process_group", lambda backend, timeout: seen.update(timeout=timeout))
    monkeypatch.setattr(cram.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(cram.dist, "get_world_size", lambda: 2)
    assert cram.setup(cram.get_args(["--device", "cpu"]))[:2] == (0, 2)
    assert seen["timeout"].total_seconds() == cram.SAVE_TIMEOUT == 3600


def test_batches_keep_numpys_permutation_in_four_bytes_a_row():
    rows = np.arange(1000, dtype=np.uint16).reshape(-1, 1).repeat(4, 1)
    data = cram.Batches(rows, 10, seed=3)
    got = np.concatenate([next(data)[:, 0] for _ in range(100)])
    want = np.random.default_rng((3, 0)).permutation(1000)
    assert (np.sort(got.reshape(100, 10), 1) == np.sort(want.reshape(100, 10), 1)).all()
    assert data.order.dtype == np.uint32 and (data.epoch, data.pos) == (0, 1000)
    next(data)
    assert data.epoch == 1 and data.pos == 10  # a new permutation every epoch


# ----------------------------------------------------------------------------- a day that fails midway
def fail_at(monkeypatch, step, error):
    """cram.train_step raises `error` at `step` (counted from 1), as the GPU would."""
    real, calls = cram.train_step, []

    def train_step(*args):
        calls.append(1)
        if len(calls) == step:
            raise error
        return real(*args)
    monkeypatch.setattr(cram, "train_step", train_step)


def test_a_non_finite_gradient_saves_the_last_good_step_and_resume_lowers_the_lr(tmp_path, data, monkeypatch, capsys):
    out, flags = str(tmp_path), ["--data", data, "--steps", "6", *TINY]
    ce, calls, before = cram.F.cross_entropy, [], {}

    def nan_at_step_4(*a, **k):  # steps 1 to 3 are one micro-batch each, at the ramp's start
        calls.append(1)
        return ce(*a, **k) * (float("nan") if len(calls) == 4 else 1.0)
    monkeypatch.setattr(cram.F, "cross_entropy", nan_at_step_4)
    real = cram.train_step

    def train_step(model, *args):  # the weights before each step
        before[len(before) + 1] = {k: v.clone() for k, v in model.state_dict().items()}
        return real(model, *args)
    monkeypatch.setattr(cram, "train_step", train_step)
    with pytest.raises(SystemExit) as e:
        cram.main([*flags, "--out", out])
    assert str(e.value) == (f"error: gradient not finite at step 4; {out}/ckpt.pt holds step 3: continue: the "
                            f"same command --resume --lr 0.0005")
    saved = cram.load_checkpoint(out + "/ckpt.pt")
    assert saved["step"] == 3 and all(torch.equal(saved["model"][k], v) for k, v in before[4].items())
    assert saved["data"][1] == sum(8 * cram.ramp(s / 6, 16, 8) for s in range(4))  # step 4's rows skipped
    monkeypatch.undo()
    capsys.readouterr()
    cram.main([*flags, "--out", out, "--resume", "--lr", "0.0005"])
    resumed = [r for r in records(out) if "lr" in r and r["step"] > 3]  # steps 4 to 6, on the halved peak
    assert [r["lr"] for r in resumed] == [cram.schedule(s / 6, 0.0005) for s in range(3, 6)]
    assert cram.load_checkpoint(out + "/ckpt.pt")["args"]["lr"] == 0.0005


def test_out_of_memory_says_how_to_go_on_smaller_and_resume_may(tmp_path, data, monkeypatch, capsys):
    out, flags = str(tmp_path), ["--data", data, "--steps", "4", *TINY, "--save-every", "1e-9"]
    fail_at(monkeypatch, 1, torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(SystemExit) as e:
        cram.main([*flags, "--out", out])
    assert str(e.value) == (f"error: out of memory at step 1; {out}/ckpt.pt holds step 0: continue: the same "
                            f"command --resume --micro-batch 4")  # a run saves at its start
    monkeypatch.undo()
    fail_at(monkeypatch, 3, torch.cuda.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(SystemExit) as e:
        cram.main([*flags, "--out", out + "/b"])
    assert str(e.value) == (f"error: out of memory at step 3; {out}/b/ckpt.pt holds step 2: continue: the same "
                            f"command --resume --micro-batch 4")
    monkeypatch.undo()
    capsys.readouterr()
    cram.main([*flags, "--out", out + "/b", "--resume", "--micro-batch", "4"])
    assert "micro-batches of 4 x 1" in capsys.readouterr().out
    log = [r for r in records(out + "/b") if "batch" in r]
    assert [r["batch"] for r in log] == [8, 8, 12, 16]  # the ramp goes on, in micro-batches of 4
    assert cram.load_checkpoint(out + "/b/ckpt.pt")["step"] == 4


def test_a_lost_gpu_keeps_torchs_traceback_and_the_last_checkpoint(tmp_path, data, monkeypatch):
    out, flags = str(tmp_path), ["--data", data, "--steps", "4", *TINY, "--save-every", "1e-9"]
    fail_at(monkeypatch, 3, RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        cram.main([*flags, "--out", out])
    assert cram.load_checkpoint(out + "/ckpt.pt")["step"] == 2  # --resume goes on from there
    monkeypatch.undo()
    cram.main([*flags, "--out", out, "--resume"])
    assert cram.load_checkpoint(out + "/ckpt.pt")["step"] == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here")
def test_cuda_out_of_memory_is_one_line_and_resume_goes_on(tmp_path, data, monkeypatch):
    out, flags = str(tmp_path), ["--data", data, "--steps", "4", *TINY, "--device", "cuda", "--save-every", "1e-9",
                                 "--no-compile"]
    real, calls = cram.train_step, []

    def too_big(*args):  # the GPU's own error, from its allocator, in the third step
        calls.append(1)
        if len(calls) == 3:
            torch.empty(1 << 50, device="cuda")
        return real(*args)
    monkeypatch.setattr(cram, "train_step", too_big)
    with pytest.raises(SystemExit) as e:
        cram.main([*flags, "--out", out])
    assert f"error: out of memory at step 3; {out}/ckpt.pt holds step 2:" in str(e.value)
    monkeypatch.undo()
    cram.main([*flags, "--out", out, "--resume", "--micro-batch", "4"])
    assert cram.load_checkpoint(out + "/ckpt.pt")["step"] == 4


def test_the_budget_runs_on_a_monotonic_clock(tmp_path, data, monkeypatch):
    """NTP may step the system clock by hours; the budget counts the seconds that pass. Both clocks
    are faked, so a busy machine runs the same steps as an idle one."""
    wall, ticks = [time.time()], [0.0]

    def stepping_clock():  # a day forward at each look
        wall[0] += 86400
        return wall[0]

    def steady_clock():  # a tenth of a second at each look
        ticks[0] += 0.1
        return ticks[0]
    monkeypatch.setattr(cram.time, "time", stepping_clock)
    monkeypatch.setattr(cram.time, "monotonic", steady_clock)
    cram.main(["--data", data, "--out", str(tmp_path), "--time", "1", *TINY])
    steps = [r for r in records(str(tmp_path)) if "lr" in r]
    elapsed = cram.load_checkpoint(str(tmp_path / "ckpt.pt"))["elapsed"]
    assert len(steps) >= 2 and 1.0 <= elapsed < 1.5  # a day at each look would have ended it at once


def test_clear_errors(tmp_path, data):
    with pytest.raises(SystemExit, match="none: no prepared data .*run prepare.py"):
        cram.main(["--data", str(tmp_path / "none"), "--out", str(tmp_path), *TINY])
    (tmp_path / "ckpt.pt").write_bytes(b"garbage")
    with pytest.raises(SystemExit, match="ckpt.pt: damaged or unreadable"):
        cram.main(["--data", data, "--out", str(tmp_path), "--resume", *TINY])
    torch.save({"something": "else"}, tmp_path / "ckpt.pt")
    with pytest.raises(SystemExit, match="ckpt.pt: not a cram checkpoint"):
        cram.main(["--data", data, "--out", str(tmp_path), "--resume", *TINY])
    cram.main(["--data", data, "--out", str(tmp_path / "a"), "--steps", "1", *TINY])
    other, out = prep(str(tmp_path), make_docs(200, seed=5)[:150], name="other")  # a tokenizer of its own
    with pytest.raises(SystemExit, match="its run's data had another tokenizer or row length than this --data"):
        cram.main(["--data", out, "--out", str(tmp_path / "a"), "--resume", *TINY])
    whole = (tmp_path / "a" / "ckpt.pt").read_bytes()
    for size in (5_000, len(whole) // 2):  # cut short: mapped, torch fails with an OSError naming no file
        (tmp_path / "a" / "ckpt.pt").write_bytes(whole[:size])
        with pytest.raises(SystemExit, match=r"a/ckpt.pt: damaged or unreadable \((OSError|RuntimeError)"):
            cram.main(["--data", data, "--out", str(tmp_path / "a"), "--fill", "a [MASK]"])




def test_compiled_training_step_matches_eager_on_cpu(tmp_path):
    """Guards the GPU path in CI: one graph (fullgraph), bf16 autocast, no recompilation."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    c = cram.ModelConfig(vocab_size=512, seq_len=32, layers=2, width=64, heads=2, ffn=128)
    model = cram.Crammed(c)
    specials = {"[PAD]": 508, "[CLS]": 509, "[SEP]": 510, "[MASK]": 511}
    compiled = torch.compile(model, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(2):  # a second batch must reuse the graph: static shapes
            batch = cram.masked(np.random.default_rng(seed).integers(0, 508, (8, 32)), specials, seed, torch.device("cpu"))
            with torch.autocast("cpu", torch.bfloat16):
                eager, fast = model(**batch), compiled(**batch)
            fast.backward()
            assert abs(eager.item() - fast.item()) < 0.02 * eager.item()
    assert all(p.grad is not None for p in model.parameters())


def test_a_run_killed_before_its_first_periodic_save_holds_its_start(tmp_path, data):
    out = str(tmp_path / "run")
    p = run_cram("--data", data, "--out", out, "--steps", "100000", *TINY)
    while not os.path.exists(os.path.join(out, "log.jsonl")) or len(records(out)) < 5:
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.05)
    p.kill()  # SIGKILL: no save, as the OOM killer or a power cut
    p.wait(60)
    start = cram.load_checkpoint(os.path.join(out, "ckpt.pt"))  # saved before the first step
    assert start["step"] == 0 and start["data"] == [0, 0]
    with pytest.raises(SystemExit, match="holds a run: continue it with --resume"):
        cram.main(["--data", data, "--out", out, "--steps", "100000", *TINY])
    with pytest.raises(SystemExit, match=r"^error: \S*nowhere/ckpt.pt: No such file or directory$"):
        cram.main(["--data", data, "--out", str(tmp_path / "nowhere"), "--resume"])


def test_the_rate_counts_training_time_only(tmp_path, data, monkeypatch):
    """A clock that moves a millisecond at each look, and two seconds in each save and validation:
    a rate that counted them would fall below a window's tokens per second, on any machine."""
    real_save, real_evaluate, ticks = cram.torch.save, cram.evaluate, [0.0]

    def clock():
        ticks[0] += 0.001
        return ticks[0]

    def slow_save(obj, f):
        ticks[0] += 2.0
        real_save(obj, f)

    def slow_evaluate(*args):
        ticks[0] += 2.0
        return real_evaluate(*args)
    monkeypatch.setattr(cram.time, "monotonic", clock)
    monkeypatch.setattr(cram.torch, "save", slow_save)
    monkeypatch.setattr(cram, "evaluate", slow_evaluate)
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "4", "--save-every", "1e-9", *TINY])
    steps = [r for r in records(str(tmp_path)) if "tok_s" in r]
    assert len(steps) == 4  # a save and a validation between every two log lines, none in the rate:
    assert all(r["tok_s"] > 16 * 32 / 0.01 for r in steps)  # a step's 16 rows of 32 in 2 ticks


def test_validation_masks_do_not_depend_on_the_micro_batch(tmp_path, data):
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "20", "--lr", "3e-3", *TINY])
    ckpt = cram.load_checkpoint(str(tmp_path / "ckpt.pt"))
    model, (meta, tok, rows) = cram.load_model(ckpt), prepare.read_prepared(data)
    scores = [cram.evaluate(model, rows["train"][:40], tok["special_tokens"], micro, torch.device("cpu"))
              for micro in (4, 8, 40)]  # 40 rows, in 10, 5 and 1 batches
    assert scores[1] == pytest.approx(scores[0], rel=1e-6) and scores[2] == pytest.approx(scores[0], rel=1e-6)


def test_out_folder_holds_a_run(tmp_path, data):
    out = str(tmp_path / "run")
    cram.main(["--data", data, "--out", out, "--steps", "2", *TINY])
    before = open(os.path.join(out, "ckpt.pt"), "rb").read()
    with pytest.raises(SystemExit, match="holds a run: continue it with --resume"):
        cram.main(["--data", data, "--out", out, "--steps", "2", *TINY])
    assert open(os.path.join(out, "ckpt.pt"), "rb").read() == before
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="^error: .*file: File exists$"):
        cram.main(["--data", data, "--out", str(tmp_path / "file"), *TINY])


@pytest.mark.parametrize("flags,msg", [
    (["--width", "65"], "--width must be even and divide by --heads"), (["--width", "63", "--heads", "3"], "--width must be even"), (["--ffn", "129"], "--ffn be even"),
    (["--batch-size", "4"], "--batch-size must be at least --micro-batch"),
    (["--micro-batch", "0"], "argument --micro-batch: 0 is not a finite number above 0"),
    (["--batch-size", "0"], "argument --batch-size: 0 is not"), (["--heads", "0"], "argument --heads: 0 is not"),
    (["--heads", "3"], "--width must be even and divide by --heads"), (["--save-every", "0"], "argument --save-every: 0.0 is not"),
    (["--eval-rows", "-1"], "argument --eval-rows: -1 is not 0 or a finite number above 0"),
    (["--log-every", "-5"], "argument --log-every: -5.0 is not 0 or"), (["--seed", "-1"], "argument --seed: -1 is not 0 or"),
    (["--fill"], "argument --fill: expected at least one argument"),
    (["--steps", "x"], "argument --steps: invalid int value")])
def test_flags_that_cannot_work_are_refused(flags, msg, data, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cram.main(["--data", data, "--out", str(tmp_path), *TINY, *flags])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "log.jsonl")


def test_damaged_data_is_named_at_start(tmp_path, data):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(data):
        (bad / f).write_bytes(open(os.path.join(data, f), "rb").read())
    with open(bad / "val.bin", "r+b") as f:
        f.truncate(64)
    with pytest.raises(SystemExit, match="val.bin: damaged or unreadable .*1 rows, meta.json says"):
        cram.main(["--data", str(bad), "--out", str(tmp_path / "o"), *TINY])
    os.remove(bad / "train.bin")
    with pytest.raises(SystemExit, match="train.bin: damaged or unreadable"):
        cram.main(["--data", str(bad), "--out", str(tmp_path / "o"), *TINY])


def test_fill_masks_with_top_5(tmp_path, data, capsys):
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "30", "--lr", "3e-3", *TINY])
    answers = cram.main(["--out", str(tmp_path), "--fill", "The cat [MASK] on the mat.",
                         "a [MASK] dog [MASK] far", "--device", "cpu"])
    out = capsys.readouterr().out
    assert len(answers) == 3 and all(len(a) == 5 for a in answers) and "[MASK] 2:" in out
    assert all(1 >= a[0][1] >= a[4][1] > 0 for a in answers)
    assert not any(w in prepare.SPECIALS for a in answers for w, _ in a)  # never a label
    enc = prepare.load_tokenizer(prepare.read_prepared(data)[1])
    ids = cram.encode_masked("The Cat [MASK] on it", enc)
    assert ids == enc.encode_ordinary("the cat") + [349] + enc.encode_ordinary(" on it")
    with pytest.raises(SystemExit, match="no \\[MASK\\] in its first 32 tokens"):
        cram.main(["--out", str(tmp_path), "--fill", "no mask here"])
    with pytest.raises(SystemExit, match="nothing/ckpt.pt: No such file or directory"):
        cram.main(["--out", str(tmp_path / "nothing"), "--fill", "a [MASK]"])


def test_alibi_penalises_distance_and_respects_padding():
    torch.manual_seed(0)
    c = cram.ModelConfig(vocab_size=300, seq_len=16, layers=2, width=32, heads=2, ffn=64, alibi=1.0)
    model = cram.Crammed(c).eval()
    assert model.slopes.tolist() == [1.0, 0.0]  # head 0 local, the last head global
    seen, sdpa = [], cram.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):  # the scores' additive mask, as attention gets it
        seen.append(attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cram.F, "scaled_dot_product_attention", spy)
        model(torch.randint(0, 296, (1, 6)))
    assert seen[0][0, 3].tolist() == [-3, -2, -1, 0, -1, -2] and seen[0][1].abs().max() == 0
    x = torch.randint(0, 296, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, 10:] = False  # row 0 is 10 real tokens and padding
    padded, alone = model(x, mask), model(x[:1, :10])
    assert torch.allclose(padded[0, :10], alone[0], atol=1e-5)
    assert cram.get_args(["--preset", "tiny"]).alibi == 1 and cram.get_args([]).alibi == 0


def test_resume_keeps_the_runs_settings_and_a_finished_run_stays_finished(tmp_path, data, capsys):
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "2", *TINY])
    for flag, value, own in [("--steps", "3", "2"), ("--width", "128", "64"), ("--seed", "1", "0")]:
        with pytest.raises(SystemExit) as e:  # a longer budget, another model or seed: a new run
            cram.main(["--data", data, "--out", str(tmp_path), "--resume", flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{flag} {value}: --resume keeps the run's own {own};" in err
    cram.main(["--data", data, "--out", str(tmp_path), "--resume", "--device", "cpu"])  # the run's own TINY
    assert "micro-batches of 8 x 1" in capsys.readouterr().out  # TINY's, not the preset's 16
    assert cram.load_checkpoint(str(tmp_path / "ckpt.pt"))["step"] == 2
    assert [r["step"] for r in records(str(tmp_path))] == [1, 2, 2, 2]  # no step more: a validation


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, data, monkeypatch):
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "1", *TINY])
    path = str(tmp_path / "ckpt.pt")
    before = open(path, "rb").read()

    def full(obj, f):  # what torch.save does when the disk is full
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64")
    monkeypatch.setattr(cram.torch, "save", full)
    with pytest.raises(SystemExit, match="ckpt.pt: cannot save .* the checkpoint on the disk, if any, is intact"):
        cram.main(["--data", data, "--out", str(tmp_path), "--resume", *TINY])  # it saves at once
    assert open(path, "rb").read() == before and not os.path.exists(path + ".tmp")


def test_ctrl_c_is_one_line_and_handlers_come_back(tmp_path, data, monkeypatch, capsys):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "1", *TINY])
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(cram, "evaluate", interrupted)  # in the validation at the end
    with pytest.raises(SystemExit) as e:
        cram.main(["--data", data, "--out", str(tmp_path / "b"), "--steps", "1", *TINY])
    assert e.value.code == 130 and capsys.readouterr().err.strip() == "error: interrupted"


def test_weight_decay_spares_only_the_layernorms():
    args = cram.get_args(["--layers", "1", "--width", "32", "--heads", "2", "--ffn", "64"])
    _, raw, opt = cram.build(cram.ModelConfig(300, 16, 1, 32, 2, 64), args, torch.device("cpu"))
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert opt.param_groups[0]["weight_decay"] == 0.01 and opt.param_groups[1]["weight_decay"] == 0
    assert id(raw.pos_scale) in decayed and id(raw.emb.weight) in decayed  # as in the official v2
    assert {n for n, p in raw.named_parameters() if id(p) not in decayed} == {
        "emb_ln.weight", "emb_ln.bias", "ln_f.weight", "ln_f.bias", "blocks.0.ln_1.weight",
        "blocks.0.ln_1.bias", "blocks.0.ln_2.weight", "blocks.0.ln_2.bias"}


# ----------------------------------------------------------------------------- glue.py
# A few rows of each task in the exact GLUE layout (tabs, headers, BOM, label spellings).
MNLI_COLS = "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\tsentence2_parse\tsentence1\tsentence2"
FIXTURES = {
    "CoLA": {"train.tsv": "gj04\t1\t\tOur friends won't buy this analysis.\ngj04\t0\t*\tThey drank the pub.\n",
             "dev.tsv": "gj04\t1\t\tThe sailors rode the breeze clear of the rocks."},  # the real dev.tsv has no final newline
    "SST-2": {"train.tsv": "sentence\tlabel\nhide new secretions from the parental units \t0\nit 's a charming journey . \t1\n",
              "dev.tsv": "sentence\tlabel\nunflinchingly bleak and desperate \t0\n"},
    "MRPC": {"train.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t702876\t702977\tAmrozi accused his brother .\t"
                          "Referring to him as \" the witness \" .\n0\t2108705\t2108831\tYucaipa owned Dominick 's .\tYucaipa bought Dominick 's .\n",
             "dev.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1355540\t1355592\tHe said so .\t\" He said so .\n"},
    "STS-B": {"train.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                           "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn air plane is taking off.\t5.000\n"
                           "1\tmain-captions\tMSRvid\t2012test\t0004\tnone\tnone\tA man is playing a large flute.\tA man is playing a flute.\t3.800\n",
              "dev.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                         "0\tmain-captions\tMSRvid\t2012test\t0000\tnone\tnone\tA man is dancing.\tA man wearing a hat is dancing.\t0.250\n"},
    "QQP": {"train.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n133273\t213221\t213222\tHow is the life of a math student?\t"
                         "Which level of prepration is enough?\t0\n402555\t536040\t536041\tHow do I control my horny emotions?\tHow do you control your horniness?\t1\n",
            "dev.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t2\t3\tWhy \"this\"?\tWhy that?\t0\n"},
    "MNLI": {"train.tsv": f"{MNLI_COLS}\tlabel1\tgold_label\n0\t31193\t31193n\tgovernment\t( ( a ) b )\t( c )\t(ROOT (S a))\t(ROOT (S c))\t"
                          "Conceptually cream skimming has two basic dimensions.\tProduct and geography are what make cream skimming work. \tneutral\tneutral\n",
             "dev_matched.tsv": f"{MNLI_COLS}\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n0\t63735\t63735n\tslate\t( a )\t( b )\t(ROOT a)\t(ROOT b)\t"
                                "The new rights are nice enough\tEveryone really likes the newest benefits \tneutral\tentailment\tneutral\tneutral\tneutral\tneutral\n",
             "dev_mismatched.tsv": f"{MNLI_COLS}\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n0\t75290\t75290c\tletters\t( a )\t( b )\t(ROOT a)\t(ROOT b)\t"
                                   "Your contribution helped.\tYour contributions were of no help.\tcontradiction\tcontradiction\tcontradiction\tcontradiction\tcontradiction\tcontradiction\n"},
    "QNLI": {"train.tsv": "index\tquestion\tsentence\tlabel\n0\tWhen did the third Digimon series begin?\tUnlike the two seasons before it.\tnot_entailment\n",
             "dev.tsv": "index\tquestion\tsentence\tlabel\n0\tWhat came into force?\tThe new constitution came into force.\tentailment\n"},
    "RTE": {"train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tNo Weapons of Mass Destruction Found in Iraq Yet.\tWeapons of Mass Destruction Found in Iraq.\tnot_entailment\n",
            "dev.tsv": "index\tsentence1\tsentence2\tlabel\n0\tDana Reeve has died.\tDana Reeve is dead.\tentailment\n"},
    "WNLI": {"train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tI stuck a pin through a carrot.\tThe carrot had a hole.\t1\n",
             "dev.tsv": "index\tsentence1\tsentence2\tlabel\n0\tThe drain is clogged with hair.\tThe hair has to be cleaned.\t0\n"},
}


def write_files(folder, files):
    os.makedirs(folder, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8", newline="") as f:
            f.write(text)


def test_glue_parsers_read_every_task_format(tmp_path):
    for task, files in FIXTURES.items():
        write_files(tmp_path / task, files)
    rd = lambda task, f="train.tsv": glue.read_tsv(str(tmp_path / task / f), task)
    assert rd("CoLA") == [("Our friends won't buy this analysis.", None, 1), ("They drank the pub.", None, 0)]
    assert rd("CoLA", "dev.tsv") == [("The sailors rode the breeze clear of the rocks.", None, 1)]
    assert rd("SST-2")[1] == ("it 's a charming journey . ", None, 1)
    assert rd("MRPC") == [("Amrozi accused his brother .", "Referring to him as \" the witness \" .", 1),
                          ("Yucaipa owned Dominick 's .", "Yucaipa bought Dominick 's .", 0)]
    assert rd("STS-B") == [("A plane is taking off.", "An air plane is taking off.", 5.0),
                           ("A man is playing a large flute.", "A man is playing a flute.", 3.8)]
    assert rd("QQP")[1] == ("How do I control my horny emotions?", "How do you control your horniness?", 1)
    assert rd("QQP", "dev.tsv") == [("Why \"this\"?", "Why that?", 0)]
    assert rd("MNLI") == [("Conceptually cream skimming has two basic dimensions.",
                           "Product and geography are what make cream skimming work. ", 1)]
    assert rd("MNLI", "dev_matched.tsv")[0][2] == 1 and rd("MNLI", "dev_mismatched.tsv")[0][2] == 2
    assert rd("QNLI") == [("When did the third Digimon series begin?", "Unlike the two seasons before it.", 1)]
    assert rd("RTE", "dev.tsv") == [("Dana Reeve has died.", "Dana Reeve is dead.", 0)]
    assert rd("WNLI") == [("I stuck a pin through a carrot.", "The carrot had a hole.", 1)]


def test_glue_bad_input_names_file_and_line(tmp_path):
    path = str(tmp_path / "train.tsv")
    cases = [("RTE", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tyes\n",
              ":2: a text column is missing, or label 'yes' \\(column 'label'\\) is not \\['entailment', "
              "'not_entailment'\\]; is this RTE\\?$"),
             ("STS-B", FIXTURES["STS-B"]["train.tsv"].replace("3.800", "high"), ":3: .* label 'high' .* is not a number"),
             ("RTE", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\n", ":3: .* label None \\(column 'label'\\)"),
             ("MRPC", "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tthe cat sat\n", ":2: a text column is missing, or"),
             ("QNLI", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n", ":2: a text column is missing, or label 'entailment' .*; is this QNLI\\?")]
    for task, text, msg in cases:
        write_files(tmp_path, {"train.tsv": text})
        with pytest.raises(SystemExit, match="^error: " + path + msg):
            glue.read_tsv(path, task)
    for tasks in ["mnli-m", "sst2", "RTE,nope", ","]:  # the names as in GLUE in any case, no aliases
        with pytest.raises(SystemExit, match=f"^error: --tasks {tasks}: name one or more of CoLA,SST-2,"):
            glue.main(["--ckpt", "c.pt", "--tasks", tasks])


def test_glue_metrics_against_hand_computed_values():
    p, y = [1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 0]  # tp 2, tn 2, fp 1, fn 1
    accuracy = lambda p, y: glue.score("SST-2", p, y)["accuracy"] / 100
    f1 = lambda p, y: glue.score("MRPC", p, y)["f1"] / 100
    pearson = lambda p, y: glue.score("STS-B", p, y)["pearson"] / 100
    assert glue.score("CoLA", p, y) == {"mcc": pytest.approx(100 * 3 / 9)}  # MCC: r of the 0/1 labels
    assert accuracy(p, y) == pytest.approx(4 / 6)
    assert f1(p, y) == pytest.approx(2 / 3)  # precision 2/3, recall 2/3
    assert pearson(p, y) == pytest.approx((2 * 2 - 1 * 1) / 9)  # sqrt(3*3*3*3) = 9
    assert pearson(y, y) == pytest.approx(1.0) and pearson([1 - v for v in y], y) == pytest.approx(-1.0)
    assert pearson([1] * 6, y) == 0.0 and pearson([0] * 6, y) == 0.0  # a constant predictor: 0, not nan
    assert f1([0] * 6, y) == 0.0 and f1([1] * 6, y) == pytest.approx(2 * 3 / (2 * 3 + 3))
    big = np.array([1, 0] * 300_000)  # counts whose 4-fold product overflows int64
    assert pearson(big, big) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)  # sum of products 1 over sqrt(2 x 2)
    assert pearson([2, 2, 2], [1, 2, 3]) == 0.0
    assert glue.score("MRPC", p, y) == {"f1": pytest.approx(200 / 3), "accuracy": pytest.approx(400 / 6)}
    assert glue.score("STS-B", [1, 2, 3], [2, 4, 6]) == {"pearson": pytest.approx(100.0)}
    some = {"RTE": {"accuracy": 60.0}, "CoLA": {"mcc": 40.0, "accuracy": 90.0}, "WNLI": {"accuracy": 0.0}}
    assert glue.glue_score(some) == (None, {"RTE": 60.0, "CoLA": 40.0})  # no GLUE score from some tasks
    nine = {s: {"accuracy": 99.0, glue.METRICS.get(s, ["accuracy"])[0]: float(i)} for i, s in enumerate(glue.COLUMNS)}
    assert glue.glue_score(nine)[0] == 4.0  # the mean of 0..8, each split's paper metric


def test_glue_encode_pairs_and_truncation():
    specials = {"[PAD]": 256, "[CLS]": 257, "[SEP]": 258, "[MASK]": 259}
    enc = glue.load_tokenizer(tokenizer())
    ids, ys = glue.encode(enc, specials, [("Ab", "c", 1), ("x" * 20, "y" * 3, 0), ("q" * 9, None, 1)], seq_len=10)
    assert ids[0].tolist() == [257, ord("a"), ord("b"), 258, ord("c"), 258] + [256] * 4  # lowercase, padded
    assert ids[1].tolist() == [257] + [ord("x")] * 4 + [258] + [ord("y")] * 3 + [258]  # the longer text is cut
    assert ids[2].tolist() == [257] + [ord("q")] * 8 + [258] and ys.tolist() == [1, 0, 1]


# ----------------------------------------------------------------------------- the task folders
def test_glue_reads_a_tasks_folder_and_a_missing_file_says_what_glue_dir_wants(tmp_path):
    write_files(tmp_path / "MNLI", FIXTURES["MNLI"])
    mnli = glue.read_task("MNLI", str(tmp_path))
    assert sorted(mnli) == ["MNLI-m", "MNLI-mm", "train"] and mnli["MNLI-mm"][0][2] == 2
    write_files(tmp_path / "RTE", {"train.tsv": FIXTURES["RTE"]["train.tsv"]})
    with pytest.raises(SystemExit, match=f"^error: {tmp_path}/RTE/dev.tsv: not there; --glue-dir wants "
                                         "the folders of GLUE's download_glue_data.py$"):
        glue.read_task("RTE", str(tmp_path))


# ----------------------------------------------------------------------------- fine-tuning
def tokenizer():
    """Bytes only: enough for the model to read letters."""
    return {"ranks": "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)),
            "pattern": r"\S+|\s+", "special_tokens": {"[PAD]": 256, "[CLS]": 257, "[SEP]": 258, "[MASK]": 259}}


def make_ckpt(path, **config):
    cfg = ModelConfig(**{**dict(vocab_size=260, seq_len=64, layers=2, width=64, heads=2, ffn=128), **config})
    torch.manual_seed(0)
    torch.save({"format": "cram-ckpt-1", "model_config": asdict(cfg), "model": Crammed(cfg).state_dict(),
                "tokenizer": tokenizer()}, path)


@pytest.mark.parametrize("device", DEVICES)
def test_glue_finetune_learns_a_synthetic_task(tmp_path, capsys, one_thread, device):
    rng = random.Random(0)
    words = ["the", "film", "was", "plot", "actor", "and", "a", "it", "long", "scene"]

    def rows(n):  # sentiment decided by one word among filler
        out = []
        for _ in range(n):
            y = rng.randint(0, 1)
            w = [rng.choice(words) for _ in range(rng.randint(2, 6))]
            w.insert(rng.randint(0, len(w)), "great" if y else "awful")
            out.append(f"{' '.join(w)} \t{y}\n")
        return "sentence\tlabel\n" + "".join(out)
    write_files(tmp_path / "glue" / "SST-2", {"train.tsv": rows(640), "dev.tsv": rows(200)})
    write_files(tmp_path / "glue" / "RTE", FIXTURES["RTE"])
    ckpt = str(tmp_path / "ckpt.pt")
    make_ckpt(ckpt)
    common = ["--ckpt", ckpt, "--glue-dir", str(tmp_path / "glue"), "--device", device]
    res = glue.main(common + ["--tasks", "SST-2", "--epochs", "5", "--lr", "1e-3"])
    assert res["SST-2"]["accuracy"] > 90
    saved = json.load(open(tmp_path / "glue.json"))
    assert saved["results"]["SST-2"]["accuracy"] == res["SST-2"]["accuracy"] and saved["average"] is None
    cap = capsys.readouterr()  # progress lines go to stderr (prepare.Progress), the table to stdout
    assert "fine-tuning: 3,200/3,200 ex" in cap.err and "ex/s | SST-2 trial 1/1, loss " in cap.err
    assert "crammed BERT v1" in cap.out and "ckpt.pt" in cap.out
    res = glue.main(common + ["--tasks", "RTE", "--epochs", "1", "--trials", "2", "--random-init"])
    assert set(json.load(open(tmp_path / "glue-random-init.json"))["results"]["RTE"]["trials"][1]) == {"accuracy"}
    assert "random init" in capsys.readouterr().out
    with open(ckpt, "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(SystemExit, match=f"error: {ckpt}: damaged or unreadable"):
        glue.main(common + ["--tasks", "RTE"])


# ----------------------------------------------------------------------------- nothing lost, no traceback
def fake_finetune(calls):
    """Stands in for fine-tuning: a score that says which call made it."""
    def finetune(ckpt, task, train, devs, args, trial, device, run):
        assert train[0].shape[1] == ckpt["model_config"]["seq_len"]  # rows cut to the checkpoint's length
        assert len(train[0]) == (args.max_train_samples or len(train[0]))
        calls.append(task)
        return {split: {m: float(len(calls)) for m in glue.METRICS.get(task, ["accuracy"])} for split in devs}
    return finetune


@pytest.fixture
def glue_run(tmp_path, monkeypatch):
    """A checkpoint, RTE and WNLI files, and main() with fine-tuning replaced by fake_finetune."""
    for task in ("RTE", "WNLI"):
        write_files(tmp_path / "glue" / task, FIXTURES[task])
    ckpt = str(tmp_path / "ckpt.pt")
    make_ckpt(ckpt)
    calls = []
    monkeypatch.setattr(glue, "finetune", fake_finetune(calls))

    def run(*flags):
        return glue.main(["--ckpt", ckpt, "--glue-dir", str(tmp_path / "glue"), "--device", "cpu", *flags])
    return run, calls, tmp_path


def accuracies(path):
    return {split: r["accuracy"] for split, r in json.load(open(path))["results"].items()}


def test_glue_json_holds_the_runs_results_each_written_when_its_task_is_done(glue_run, monkeypatch):
    run, calls, tmp = glue_run
    (tmp / "glue.json").write_text('{"results": {"WNLI"')  # an earlier run's, cut short: replaced
    run("--tasks", "RTE", "--trials", "2", "--seed", "3")
    saved = json.load(open(tmp / "glue.json"))
    assert saved["results"] == {"RTE": {"accuracy": 1.5, "trials": [{"accuracy": 1.0}, {"accuracy": 2.0}]}}
    assert saved["settings"]["seed"] == 3 and saved["average"] is None  # not all nine: no GLUE score
    real = glue.finetune  # the second task stopped by Ctrl-C: the first one's results are kept

    def stopped(ckpt, task, *args):
        if task == "RTE":
            raise KeyboardInterrupt
        return real(ckpt, task, *args)
    monkeypatch.setattr(glue, "finetune", stopped)
    with pytest.raises(SystemExit):
        run("--tasks", "wnli,RTE")  # any case
    assert accuracies(tmp / "glue.json") == {"WNLI": 3.0} and calls == ["RTE", "RTE", "WNLI"]


def test_glue_average_is_the_papers_mean_of_nine_splits(glue_run, capsys):
    run, calls, tmp = glue_run
    for task, files in FIXTURES.items():
        write_files(tmp / "glue" / task, files)
    run("--tasks", "CoLA,SST-2,MRPC,STS-B,QQP,MNLI,QNLI,RTE")
    saved, out = json.load(open(tmp / "glue.json")), capsys.readouterr().out
    assert saved["average"] == pytest.approx(np.mean([1, 2, 3, 4, 5, 6, 6, 7, 8]))  # MNLI: m and mm
    assert saved["settings"]["max_train_samples"] is None and saved["settings"]["pool"] == "first"
    assert "ours: the median of 1 trial(s) per task; the paper's rows: medians of 5 (--trials 5), v2's: the best of 5" in out
    row = "".join(f"{v:8.1f}" for v in [6, 6, 2, 4, 8, 7, 5, 3, 1, 42 / 9])  # COLUMNS' order, GLUE
    assert f"{'ckpt.pt':29s}{row}\n" in out and out.endswith(f"wrote {tmp}/glue.json\n")


def test_glue_ctrl_c_exits_130_and_keeps_glue_json(glue_run, monkeypatch, capsys):
    run, calls, tmp = glue_run
    run("--tasks", "WNLI")
    before = (tmp / "glue.json").read_bytes()

    def interrupted(*args):
        raise KeyboardInterrupt
    for name in ("finetune", "read_tsv"):  # while fine-tuning, and while reading the files
        monkeypatch.setattr(glue, name, interrupted)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit:
            run("--tasks", "RTE")
        assert exit.value.code == 130 and capsys.readouterr().err == "error: interrupted\n"
        assert (tmp / "glue.json").read_bytes() == before


def test_glue_checks_every_file_before_fine_tuning(glue_run, capsys):
    run, calls, tmp = glue_run
    write_files(tmp / "glue" / "WNLI", {"dev.tsv": "index\tsentence1\tsentence2\tlabel\n0\ta\tb\t7\n"})
    with pytest.raises(SystemExit, match=r"WNLI/dev.tsv:2: .* label '7'"):
        run("--tasks", "RTE,WNLI")
    assert calls == [] and not os.path.exists(tmp / "glue.json") and "trial" not in capsys.readouterr().err
    os.remove(tmp / "glue" / "RTE" / "dev.tsv")
    os.mkdir(tmp / "glue" / "RTE" / "dev.tsv")  # a file that cannot be read, even by root
    with pytest.raises(SystemExit, match=r"^error: \S*RTE/dev.tsv: Is a directory$"):
        run("--tasks", "RTE")
    assert calls == []


def test_glue_flags(glue_run, capsys):
    run, calls, tmp = glue_run
    for flags, msg in [(["--epochs", "x"], "argument --epochs: invalid int value: 'x'"),
                       (["--max-len", "64"], "unrecognized arguments: --max-len 64"),
                       (["--trials", "0"], "argument --trials: 0 is not a finite number above 0"),
                       (["--epochs", "-1"], "argument --epochs: -1 is not"),
                       (["--max-train-samples", "0"], "argument --max-train-samples: 0 is not")]:
        with pytest.raises(SystemExit):
            run("--tasks", "RTE", *flags)
        assert msg in capsys.readouterr().err
    assert calls == []
    run("--tasks", "RTE,WNLI", "--max-train-samples", "1")  # the first example of each task
    assert calls == ["RTE", "WNLI"] and json.load(open(tmp / "glue.json"))["settings"]["max_train_samples"] == 1


def test_glue_head_help_and_truncation_example(capsys):
    cfg = ModelConfig(vocab_size=260, seq_len=64, layers=1, width=64, heads=2, ffn=128)
    model = glue.Classifier(Crammed(cfg), 3, pad=256)  # the encoder is built by the caller
    assert glue.HEAD_DIM == 1024 and model.head[0].out_features == 1024 and model.head[3].in_features == 1024
    assert model.head[2].p == glue.DROPOUT == 0.1 and model.head[3].out_features == 3
    idx = torch.tensor([[257, 1, 2, 258, 256, 256], [257, 3, 258, 256, 256, 256]])
    model.eval()
    assert model(idx).shape == (2, 3)  # the first token's row; [PAD] is masked out:
    assert torch.allclose(model(idx[:, :4])[0], model(idx)[0], atol=1e-5)
    with pytest.raises(SystemExit):
        glue.main(["--help"])
    text = capsys.readouterr().out
    import re
    for block in re.split(r"\n  (?=-)", text.split("options:")[1])[1:]:  # each flag says what it is
        flags, said = re.split(r"\s{2,}", block.strip(), maxsplit=1)
        assert len(re.sub(r"\(default: [^)]*\)", "", said).split()) >= 2, flags
    assert "--batch-size BATCH_SIZE examples per optimizer step (default: 16)" in " ".join(text.split())
    help_text = " ".join(text.split())
    for flag, name in [("lr", "LR"), ("epochs", "EPOCHS"), ("batch-size", "BATCH_SIZE")]:
        assert f"--{flag} {flag.upper().replace('-', '_')} " in help_text
        assert f"(default: {getattr(glue, name)})" in help_text

    def cut(a, b, room):  # the worked example of truncate's docstring, in lengths
        return tuple(map(len, glue.truncate(list(range(a)), list(range(b)), room)))
    assert cut(100, 60, 125) == (65, 60) and cut(100, 90, 125) == (63, 62) and cut(200, 0, 126) == (126, 0)
    # the schedule: 10% linear warm-up to the peak, then cosine down to zero
    assert [glue.learning_rate(s, 20, 1.0) for s in (0, 1, 2)] == [0.0, 0.5, 1.0] and glue.learning_rate(11, 20, 1.0) == pytest.approx(0.5)


# ----------------------------------------------------------------------------- GLUE at GPU speed
def glue_rows(lengths, seq_len=128):
    """Encoded one-sentence rows of these many letters (the byte tokenizer: one token each)."""
    texts = [("x" * n, None, i % 2) for i, n in enumerate(lengths)]
    return glue.encode(glue.load_tokenizer(tokenizer()), tokenizer()["special_tokens"], texts, seq_len)


def test_glue_bucketed_padding_changes_no_output():
    """fp32, eval mode: the logits of a batch padded to its bucket equal those cut to its longest row."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=260, seq_len=128, layers=2, width=64, heads=2, ffn=128, alibi=0.5)
    model = glue.Classifier(Crammed(cfg), 3, pad=256).eval()
    ids, _ = glue_rows([3, 38, 15])  # 5, 40 and 17 tokens with [CLS] and [SEP]
    bucketed, trimmed = glue.bucket(ids, 256, glue.BUCKET), glue.bucket(ids, 256, 1)
    assert bucketed.shape == (3, 64) and trimmed.shape == (3, 40) and torch.equal(trimmed, ids[:, :40])
    with torch.no_grad():
        for model.pool in ("first", "mean"):
            assert torch.allclose(model(bucketed), model(trimmed), atol=1e-5, rtol=0)
            assert torch.allclose(model(ids), model(trimmed), atol=1e-5, rtol=0)


def test_glue_pool_mean_reads_the_mean_of_the_tokens():
    """--pool mean: the head reads the mean of the hidden states at the non-padding positions."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=260, seq_len=64, layers=2, width=64, heads=2, ffn=128, alibi=0.5)
    model = glue.Classifier(Crammed(cfg), 1, pad=256, pool="mean").eval()
    ids, _ = glue_rows([3, 9], seq_len=64)  # 5 and 11 tokens
    with torch.no_grad():
        h = model.encoder(ids, ids != 256)  # (2, 64, width)
        by_hand = torch.stack([h[0, :5].mean(0), h[1, :11].mean(0)])  # (2, width)
        assert torch.allclose(model(ids), model.head(by_hand), atol=1e-5, rtol=0)
        assert not torch.allclose(model.head(by_hand), model.head(h[:, 0]), atol=1e-3)
        model.pool = "first"  # v2's head: the first token, [CLS]
        assert torch.allclose(model(ids), model.head(h[:, 0]), atol=1e-5, rtol=0)


def pair_tsv(label, lengths, rng, labels=None):
    """A pair task's tsv, a row of each length in tokens ([CLS] a [SEP] b [SEP], a byte a token)."""
    lines = ["sentence1\tsentence2\t" + label]
    for tokens in lengths:
        a = rng.randint(1, tokens - 4)
        y = rng.choice(labels) if labels else f"{rng.uniform(0, 5):.3f}"
        lines.append(f"{'x' * a}\t{'y' * (tokens - 3 - a)}\t{y}")
    return "\n".join(lines) + "\n"


def test_glue_a_compiled_run_compiles_once_and_scores_as_eager(tmp_path, monkeypatch, one_thread):
    """The CUDA path on the CPU: dynamo with a backend of our own that counts the graphs and runs
    them as they are. Three tasks of head sizes 3, 1 and 2, two trials each, on one kept
    classifier per head size: each trial scores what an eager, fresh model does, to the last digit
    (every row's length is a multiple of 32, so the buckets are the eager cut). A second trial
    compiles no (head size, length) an earlier one did: a run compiles at most 3 head sizes x 4
    lengths, more than dynamo's default limit of 8; a trial's last, smaller batch runs eagerly."""
    rng = random.Random(0)
    nli, yes_no = ["entailment", "neutral", "contradiction"], ["entailment", "not_entailment"]
    train, dev = [32] * 66 + [64, 64, 96, 128], [32, 64, 96, 128] * 5  # batches of every length
    write_files(tmp_path / "glue" / "MNLI", {"train.tsv": pair_tsv("gold_label", train, rng, nli),
                                              "dev_matched.tsv": pair_tsv("gold_label", dev, rng, nli),
                                              "dev_mismatched.tsv": pair_tsv("gold_label", dev, rng, nli)})
    write_files(tmp_path / "glue" / "STS-B", {"train.tsv": pair_tsv("score", train, rng),
                                               "dev.tsv": pair_tsv("score", dev, rng)})
    write_files(tmp_path / "glue" / "RTE", {"train.tsv": pair_tsv("label", train, rng, yes_no),
                                             "dev.tsv": pair_tsv("label", dev, rng, yes_no)})
    make_ckpt(str(tmp_path / "ckpt.pt"), seq_len=128, layers=1)
    flags = ["--ckpt", str(tmp_path / "ckpt.pt"), "--glue-dir", str(tmp_path / "glue"), "--device", "cpu",
             "--tasks", "MNLI,STS-B,RTE", "--trials", "2", "--epochs", "2", "--lr", "1e-3"]
    eager = glue.main(flags)
    graphs = []

    def count(graph, example_inputs):  # a graph's (head size, length): its head's weight, its ids
        weights = [*example_inputs, *graph.parameters()]  # torch 2.4 keeps the weights in the graph
        head = [x.shape[0] for x in weights if x.shape[1:] == (glue.HEAD_DIM,)]
        ids = [x.shape[1] for x in example_inputs if x.dtype == torch.long]
        graphs.append((*head, *ids))
        return graph.forward
    compile, Run = torch.compile, glue.Run
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compile(model, backend=count, **kwargs))
    monkeypatch.setattr(glue, "Run", lambda examples, compile: Run(examples, compile=True))
    monkeypatch.setattr(torch._dynamo.config, "cache_size_limit", 8)  # main raises it; put back after
    compiled = glue.main(flags)
    assert compiled == eager and set(compiled) == {"MNLI-m", "MNLI-mm", "STS-B", "RTE"}
    assert len(set(t["pearson"] for t in compiled["STS-B"]["trials"])) == 2  # the trials differ
    assert len(set(graphs)) == len(graphs) and set(graphs) <= {(n, t) for n in (1, 2, 3) for t in (32, 64, 96, 128)}
    assert len(graphs) > 8, graphs  # over dynamo's default limit: main raised it


def test_glue_evaluation_cuts_each_batch_to_its_own_longest_row(tmp_path, monkeypatch, one_thread):
    """Eager (the CPU; the GPU's evaluation too), every batch is cut to its longest row, never
    padded to a multiple of 32; the dev rows are read MICRO_BATCH at a time."""
    shapes, forward = [], glue.Classifier.forward

    def recorded(self, idx):
        shapes.append((torch.is_grad_enabled(), *idx.shape))
        return forward(self, idx)
    monkeypatch.setattr(glue.Classifier, "forward", recorded)
    make_ckpt(str(tmp_path / "ckpt.pt"), seq_len=128, layers=1)
    ckpt, m = torch.load(tmp_path / "ckpt.pt"), glue.MICRO_BATCH
    train = glue_rows([5] * 32)  # 7 tokens with [CLS] and [SEP]
    dev = glue_rows([3] * (m - 1) + [70] + [10] * m + [20] * 44)
    args = glue.get_args(["--ckpt", "unused", "--epochs", "1"])
    glue.finetune(ckpt, "SST-2", train, {"SST-2": dev}, args, 0, torch.device("cpu"), glue.Run(32, False))
    assert shapes == [(True, 16, 7)] * 2 + [(False, m, 72), (False, m, 12), (False, 44, 22)]


def test_glue_says_the_runs_examples_and_the_runs_eta(tmp_path, monkeypatch, capsys, one_thread):
    rng = random.Random(0)
    write_files(tmp_path / "glue" / "RTE", {"train.tsv": pair_tsv("label", [32] * 40, rng, ["entailment", "not_entailment"]),
                                             "dev.tsv": FIXTURES["RTE"]["dev.tsv"]})
    write_files(tmp_path / "glue" / "STS-B", {"train.tsv": pair_tsv("score", [40] * 20, rng),
                                               "dev.tsv": pair_tsv("score", [20] * 9, rng)})
    make_ckpt(str(tmp_path / "ckpt.pt"), seq_len=128, layers=1)
    clock = [1000.0]

    def three_seconds_a_look():  # what Progress reads: a step takes 3 s
        clock[0] += 3.0
        return clock[0]
    monkeypatch.setattr(prepare, "time", argparse.Namespace(time=three_seconds_a_look))
    glue.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--glue-dir", str(tmp_path / "glue"), "--device", "cpu",
               "--tasks", "RTE,STS-B", "--trials", "2", "--epochs", "2", "--max-train-samples", "30"])
    out, err = capsys.readouterr()
    assert out.startswith("fine-tuning on 200 examples in all: 2 trial(s) x 2 epochs x 50 training examples of 2 task(s)\n")
    lines = err.splitlines()  # 3 s in, no ETA yet; 6 s in, 32 done: 168 left at 5.3 a second, the run's
    assert lines[0].startswith("fine-tuning: 16/200 ex, 5.3 ex/s | RTE trial 1/2, loss ")
    assert lines[1].startswith("fine-tuning: 32/200 ex, ETA 0:31, 5.3 ex/s | RTE trial 1/2, loss ")
    assert lines[-1].startswith("fine-tuning: 200/200 ex, ETA 0:00, ") and "| STS-B trial 2/2, loss " in lines[-1]


@CUDA
def test_cuda_glue_fine_tuning_steps_never_wait_for_the_gpu(tmp_path, monkeypatch):
    """After the first step (it compiles), a step copies pinned inputs and reads nothing off the
    GPU: under sync debug mode "error" any wait raises. Reading the loss at the last step is one.
    A second trial on the same compiled model starts as the first; its last, smaller batch runs
    eagerly, and waits for nothing either."""
    class CheckSync:  # stands in for Progress, which reads the loss only at the last step here
        def __init__(self, *args):
            pass

        def __call__(self, done, extra, force=False):
            torch.cuda.set_sync_debug_mode(0 if force else "error")
    monkeypatch.setattr(glue, "Progress", CheckSync)
    make_ckpt(str(tmp_path / "ckpt.pt"))
    ckpt = torch.load(tmp_path / "ckpt.pt")
    train = glue_rows([10, 20] * 32 + [15], seq_len=64)  # one bucket (32 tokens), 4 batches an epoch and 1 row
    args = glue.get_args(["--ckpt", "unused", "--epochs", "3", "--lr", "1e-3", "--trials", "2"])
    run = glue.Run(3 * 65 * 2, compile=True)
    try:
        for trial in range(2):
            scores = glue.finetune(ckpt, "SST-2", train, {"SST-2": train}, args, trial, torch.device("cuda"), run)
            assert 0 <= scores["SST-2"]["accuracy"] <= 100
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_glue_device_and_lr_are_refused_before_any_work(glue_run, capsys):
    run, calls, tmp = glue_run
    for device in ["cuda:99", "mps"]:
        with pytest.raises(SystemExit, match=f"^error: --device {device}: not a device of this machine"):
            run("--tasks", "RTE", "--device", device)
    for lr in ["nan", "-0.001", "0", "inf"]:  # AdamW's ValueError traceback, or a run of nan or nothing
        with pytest.raises(SystemExit):
            run("--tasks", "RTE", "--lr", lr)
        assert f"error: argument --lr: {float(lr)} is not a finite number above 0" in capsys.readouterr().err
    assert calls == [] and not os.path.exists(tmp / "glue.json")


def test_glue_full_disk_names_glue_json_and_keeps_the_earlier_one(glue_run, monkeypatch):
    run, calls, tmp = glue_run
    run("--tasks", "WNLI")
    before = (tmp / "glue.json").read_bytes()

    def full(data, f, **kwargs):  # a write to a full disk: an OSError that names no file
        f.write('{"results": {')
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(glue.json, "dump", full)
    with pytest.raises(SystemExit, match=f"^error: {tmp}/glue.json: No space left on device$"):
        run("--tasks", "RTE")
    assert (tmp / "glue.json").read_bytes() == before and not os.path.exists(tmp / "glue.json.tmp")


def test_prepare_unwritable_out_is_one_line(tmp_path):
    src = write_jsonl(str(tmp_path / "a.jsonl"), make_docs(20))
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit, match="^error: .*afile: File exists$"):
        prepare.main(["--input", src, "--out", str(tmp_path / "afile")])


# ----------------------------------------------------------------------------- damaged inputs and unwritable outputs
def copy_data(data, to):
    shutil.copytree(data, to)
    return str(to)


def deny(monkeypatch, *paths, new_in=None):
    """Permission denied as a user who is not root meets it (the tests may run as root, whom chmod
    does not stop): opening any of `paths`, or creating a file in the folder `new_in` (read-only)."""
    real, denied = builtins.open, {os.path.abspath(p) for p in paths}

    def guarded(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)):
            path = os.path.abspath(file)
            creates = any(c in mode for c in "wxa") and not os.path.exists(path)
            if path in denied or (creates and new_in and os.path.dirname(path) == os.path.abspath(new_in)):
                raise PermissionError(13, "Permission denied", str(file))
        return real(file, mode, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", guarded)
    monkeypatch.setattr(io, "open", guarded)  # pathlib opens through io.open


def test_a_truncated_tokenizer_file_is_a_damaged_folder(tmp_path, data):
    bad = copy_data(data, tmp_path / "bad")
    path = os.path.join(bad, "tokenizer.tiktoken")
    lines = open(path).read().splitlines(keepends=True)
    with open(path, "w") as f:
        f.write("".join(lines[:len(lines) // 2]))  # cut to half, at a line: it still parses
    vocab = json.load(open(os.path.join(bad, "meta.json")))["vocab_size"]
    says = (f"^error: {path}: damaged or unreadable \\(ValueError: {len(lines) // 2 + 4} tokens, specials too; "
            f"meta.json says {vocab}\\); prepare the data again into another --out, or remove {bad} first$")
    with pytest.raises(SystemExit, match=says):
        cram.main(["--data", bad, "--out", str(tmp_path / "o"), *TINY, "--steps", "2"])
    assert not os.path.exists(tmp_path / "o" / "ckpt.pt")


def test_damaged_folder_message_says_what_works(tmp_path, data):
    bad = copy_data(data, tmp_path / "bad")
    os.remove(os.path.join(bad, "train.bin"))
    with pytest.raises(SystemExit) as e:
        prepare.read_prepared(bad)
    msg = str(e.value.code)
    assert msg.endswith(f"; prepare the data again into another --out, or remove {bad} first"), msg
    with pytest.raises(SystemExit, match="holds prepared data"):  # what the old message sent the user into
        prepare.main(["--input", write_jsonl(str(tmp_path / "x.jsonl"), make_docs(5)), "--out", bad])


def test_glue_files_empty_header_only_or_not_utf8_are_one_line(glue_run):
    run, calls, tmp = glue_run
    header = "index\tsentence1\tsentence2\tlabel\n"
    path = tmp / "glue" / "RTE" / "dev.tsv"
    for text, says in [(b"", ": no examples"), (header.encode(), ": no examples"),
                       ((header + "0\ta\tb\tentailment\n1\tcaf\xe9\tb\tentailment\n").encode("latin-1"),
                        ": damaged or unreadable \\(UnicodeDecodeError: .* byte 0xe9 .*\\); GLUE's files are UTF-8$")]:
        path.write_bytes(text)
        with pytest.raises(SystemExit, match=f"^error: {path}{says}"):
            run("--tasks", "RTE")
    write_files(tmp / "glue" / "CoLA", {"train.tsv": "gj04\t1\t\tA b.\n", "dev.tsv": ""})  # CoLA: no header
    with pytest.raises(SystemExit, match="CoLA/dev.tsv: no examples"):
        run("--tasks", "CoLA")
    assert calls == []


def test_unwritable_outputs_are_found_at_start(glue_run, data, monkeypatch):
    run, calls, tmp = glue_run
    out, train_step, steps = tmp / "run", cram.train_step, []

    def signalled_at_step_2(*args):  # a run of 40 steps stopped by a signal in its second
        steps.append(1)
        if len(steps) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(*args)
    with monkeypatch.context() as m:
        m.setattr(cram, "train_step", signalled_at_step_2)
        with pytest.raises(SystemExit):
            cram.main(["--data", data, "--out", str(out), "--steps", "40", *TINY])
    log = (out / "log.jsonl").read_bytes()
    with monkeypatch.context() as m:
        deny(m, new_in=out)  # a read-only run folder: no new file, so no checkpoint either
        with pytest.raises(SystemExit, match=f"^error: {out}/ckpt.pt: cannot save .*Permission denied"):
            cram.main(["--data", data, "--out", str(out), "--resume", *TINY])
    assert (out / "log.jsonl").read_bytes() == log  # not one of the 38 steps left was trained
    deny(monkeypatch, new_in=tmp)  # glue.json's folder
    with pytest.raises(SystemExit, match=f"^error: {tmp}/glue.json.tmp: Permission denied$"):
        run("--tasks", "RTE")
    assert calls == []


def test_permission_denied_is_not_missing_or_damaged(tmp_path, data, monkeypatch):
    cram.main(["--data", data, "--out", str(tmp_path / "o"), "--steps", "1", *TINY])
    ckpt = str(tmp_path / "o" / "ckpt.pt")
    for path in [os.path.join(data, "meta.json"), os.path.join(data, "train.bin"), ckpt]:
        with monkeypatch.context() as m:
            deny(m, path)
            with pytest.raises(SystemExit, match=f"^error: {path}: Permission denied$"):
                cram.main(["--data", data, "--out", str(tmp_path / "o"), "--resume", *TINY])
    with monkeypatch.context() as m:
        deny(m, ckpt)
        with pytest.raises(SystemExit, match=f"^error: {ckpt}: Permission denied$"):
            cram.main(["--out", str(tmp_path / "o"), "--fill", "a [MASK]"])


def test_ctrl_c_in_the_final_validation_stops_at_once(tmp_path, data, monkeypatch, capsys):
    """Once the final checkpoint is saved, Ctrl-C is Python's again: a CPU with 11,000 held-out rows
    would otherwise keep it waiting for long. It ends as every Ctrl-C does: one line, exit 130."""
    decode, after = cram.Crammed.decode, []

    def signalled(self, hidden, positions):  # in evaluate (no grad), the first micro-batch sends SIGINT
        if not torch.is_grad_enabled():
            after.append(1)
            if len(after) == 1:
                os.kill(os.getpid(), signal.SIGINT)
        return decode(self, hidden, positions)
    monkeypatch.setattr(cram.Crammed, "decode", signalled)
    # the caller's Ctrl-C is Python's, as in a terminal; a shell's `cmd &` would have it ignored
    caller = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as e:
            cram.main(["--data", data, "--out", str(tmp_path), "--steps", "1", *TINY, "--micro-batch", "1"])
    finally:
        signal.signal(signal.SIGINT, caller)
    assert e.value.code == 130 and len(after) == 1  # stopped after the micro-batch it was in
    assert not any("val_loss" in r for r in records(str(tmp_path)))  # no half-validation logged
    assert capsys.readouterr().err == "error: interrupted\n"
    assert cram.load_checkpoint(str(tmp_path / "ckpt.pt"))["step"] == 1


# ----------------------------------------------------------------------------- the GPU's own settings
def test_gated_mlp_as_two_products_is_the_same_function():
    """The value and gate are two products with the halves of one weight (no concatenation in the
    backward): the same parameters, keys and function as one product split after."""
    torch.manual_seed(0)
    mlp = cram.GatedMLP(ModelConfig(width=32, ffn=96))
    assert list(mlp.state_dict()) == ["fc.weight", "out.weight"] and mlp.fc.weight.shape == (96, 32)
    x = torch.randn(3, 5, 32, requires_grad=True)
    value, gate = mlp.fc(x).chunk(2, dim=-1)
    split_after = mlp.out(value * torch.nn.functional.gelu(gate))
    grads_split = torch.autograd.grad(split_after.square().sum(), [x, *mlp.parameters()])
    two_products = mlp(x)
    grads_two = torch.autograd.grad(two_products.square().sum(), [x, *mlp.parameters()])
    torch.testing.assert_close(two_products, split_after, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_two, grads_split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class FakeGPU:
    total_memory = 0


@pytest.mark.parametrize("gb,micro", [(141, 512), (80, 512), (40.1, 512), (24, 256), (16, 128)])
def test_the_micro_batch_the_gpu_holds(monkeypatch, gb, micro):
    gpu = FakeGPU()
    gpu.total_memory = gb * 1e9
    monkeypatch.setattr(cram.torch.cuda, "get_device_properties", lambda device: gpu)
    monkeypatch.setattr(cram, "pick_device", lambda name: torch.device("cuda"))
    assert cram.get_args([]).micro_batch == micro
    assert cram.get_args(["--batch-size", "64"]).micro_batch == 8  # the ramp starts at 1/8 of it
    monkeypatch.setenv("WORLD_SIZE", "8")  # 8 GPUs start the ramp at 8 x 128 = 1/8 of 8192
    assert cram.get_args([]).micro_batch == min(micro, 128)
    assert cram.get_args(["--preset", "tiny"]).micro_batch == 16  # the CPU demo's, on any GPU
    assert cram.ramp(0.0, 8192, micro) == 1 and cram.ramp(0.6, 8192, micro) == 8192 // micro


def test_the_help_says_what_each_flag_is_and_both_presets_defaults(capsys):
    with pytest.raises(SystemExit):
        cram.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for said in ["sequences per forward pass (crammed: 128 to 512 by GPU memory", "tiny 16)",
                 "hidden size (crammed 768, tiny 128)", "peak learning rate (crammed 0.001, tiny 0.006)",
                 "seconds between log lines (10)", "seconds between checkpoints", "held-out rows"]:
        assert said in help_text


def test_a_chosen_micro_batch_is_said_and_kept_by_resume(tmp_path, data, capsys):
    flags = [f for f in TINY if f not in ("--micro-batch", "8")]
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "2", *flags, "--batch-size", "512"])
    assert "micro-batches of 64 x 1, the batch ramps from 64" in capsys.readouterr().out  # 128, at most 512 / 8
    cram.main(["--data", data, "--out", str(tmp_path), "--resume", "--device", "cpu"])
    assert cram.load_checkpoint(str(tmp_path / "ckpt.pt"))["args"]["micro_batch"] == 64


def test_mfu_divides_the_models_flops_by_one_named_peak(tmp_path, data):
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "3", *TINY])
    c = cram.ModelConfig(**cram.load_checkpoint(str(tmp_path / "ckpt.pt"))["model_config"])
    for r in records(str(tmp_path))[:-1]:  # the FLOPs of the tokens a second, over the H100's peak
        assert abs(r["mfu"] * 989e12 / cram.flops_per_token(c) - r["tok_s"]) <= 0.5  # tok_s: rounded


# ----------------------------------------------------------------------------- nothing lost, round three
def test_eval_rows_0_means_no_validation(tmp_path, data, capsys):
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "3", *TINY, "--save-every", "1e-9",
               "--eval-rows", "0"])
    log = records(str(tmp_path))
    assert not any("val_loss" in r for r in log) and log[-1]["step"] == 3
    assert cram.load_checkpoint(str(tmp_path / "ckpt.pt"))["step"] == 3


@pytest.mark.parametrize("device", ["cuda:7", "mps", "nonsense"])
def test_a_device_this_machine_lacks_is_one_line_before_the_data(tmp_path, device):
    for script in (cram, glue):
        flags = ["--data", str(tmp_path / "nowhere")] if script is cram else ["--ckpt", str(tmp_path / "none.pt")]
        with pytest.raises(SystemExit) as e:
            script.main([*flags, "--device", device])
        assert str(e.value).startswith(f"error: --device {device}: not a device of this machine (it has the CPU")


@pytest.mark.parametrize("lr", ["nan", "-0.001", "0", "inf"])
def test_a_learning_rate_that_cannot_work_is_refused_in_one_line(tmp_path, data, lr, capsys):
    with pytest.raises(SystemExit) as e:
        cram.main(["--data", data, "--out", str(tmp_path), "--steps", "1", *TINY, "--lr", lr])
    assert e.value.code == 2 and f"error: argument --lr: {float(lr)} is not a finite number above 0" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "log.jsonl")


@pytest.mark.parametrize("flag,value,said", [("--steps", "0", "0"), ("--steps", "-3", "-3"), ("--time", "-1", "-1.0"),
                                             ("--time", "0", "0.0"), ("--time", "inf", "inf")])
def test_a_budget_that_cannot_work_is_refused_in_one_line(tmp_path, data, flag, value, said, capsys):
    """--steps 0 would fall back to a day of --time; --time -1 would never end (and its lr turn negative)."""
    with pytest.raises(SystemExit) as e:
        cram.main(["--data", data, "--out", str(tmp_path), *TINY, flag, value])
    assert e.value.code == 2 and f"error: argument {flag}: {said} is not a finite number above 0" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "log.jsonl")


def test_the_first_line_says_the_batch_the_ramp_reaches(tmp_path, data, capsys):
    """The ramp counts whole micro-batches: --batch-size 20 in micro-batches of 8 ends at 2 x 8 = 16."""
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "2", *TINY, "--batch-size", "20"])
    assert "the batch ramps from 8 to 16 on cpu" in capsys.readouterr().out
    assert cram.ramp(1.0, 8192, 512 * 3) * 512 * 3 == 7680  # three GPUs at 512: not 8192


# ----------------------------------------------------------------------------- the README stays true
def map_of_the_paper():
    """The README's map: (row, script, [object names], [line ranges]) for each row."""
    import inspect, re
    text = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    table = text.split("### Map of the paper")[1].split("\n\n")[1]
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[1])
        script = {"cram.py": cram, "prepare.py": prepare, "glue.py": glue}[names[0]]
        objects = [script] * len(names[1:])
        for k, name in enumerate(names[1:]):
            for part in name.split("."):
                objects[k] = getattr(objects[k], part)
        found = []
        for obj in objects:
            lines, start = inspect.getsourcelines(obj)
            found.append(f"{start}\u2013{start + len(lines) - 1}")
        yield cells[0], cells[2].split(", "), found


def test_the_readmes_map_of_the_paper_gives_the_lines_of_the_code():
    rows = list(map_of_the_paper())
    assert len(rows) > 15
    for paper, said, found in rows:
        assert said == found, paper



# ----------------------------------------------------------------------------- figures/plot.py
def test_the_pictures_read_a_runs_own_files(tmp_path, data):
    """What figures/plot.py reads (no matplotlib needed): a run's log, its budget, its GLUE
    trials, the unigram entropy of its data, and the overlap of the budgets."""
    sys.path.insert(0, os.path.join(HERE, "figures"))
    import plot
    run = str(tmp_path / "run")
    cram.main(["--data", data, "--out", run, "--time", "3", *TINY, "--log-every", "0.5"])
    steps, vals = plot.read_log(run)
    assert vals[-1]["step"] == torch.load(os.path.join(run, "ckpt.pt"))["step"] > steps[0]["step"]
    assert round(steps[-1]["elapsed"] + steps[-1]["left"]) == 3  # a record's budget: --time
    meta, _, rows = prepare.read_prepared(data)
    counts = np.bincount(rows["train"].ravel())[:min(meta["special_tokens"].values())]
    p = counts[counts > 0] / counts.sum()  # the ordinary tokens: a special is never masked
    assert plot.unigram_entropy(data) == pytest.approx(-(p * np.log(p)).sum())
    assert plot.sts_trials(os.path.join(run, "glue.json")) == []
    (tmp_path / "glue.json").write_text(json.dumps({"results": {"STS-B": {"trials": [
        {"pearson": 17.5}, {"pearson": 20.0}]}}}))
    assert plot.sts_trials(str(tmp_path / "glue.json")) == [17.5, 20.0]
    assert plot.overlap({1: [17, 19], 3: [18, 20]}) == 0.75
    assert plot.overlap({1: [17], 3: [18], 10: [16]}) == 1 / 3
