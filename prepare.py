"""
prepare.py: raw English text -> a BPE tokenizer trained on it -> packed, memmapped rows.

The Cramming recipe (Geiping & Goldstein 2023): normalise (NFD, strip accents, lowercase),
drop duplicates and "trash" documents that tokenize badly, train the tokenizer on the
corpus itself, join documents with [SEP] and cut the stream into 128-token rows. Worker
processes parse, normalise and encode; the main process deduplicates, holds out val and
packs, so the output is byte-identical for any --workers. C4 shards download one ahead.

C4 shards (~0.17 B tokens, ~320 MB of gzip each) for a day that reads each token once:
    the paper's GPU at the v2 pace     5.5 B tokens/day     33 shards (the default)
    an H100 at 800k tokens/s            69 B tokens/day    406 shards (--tokens 69e9)

    python prepare.py                              # download C4 shards, write data/
    python prepare.py --input corpus.jsonl.gz      # or use local files, fully offline
    python prepare.py --input more.txt --tokenizer data/ --out heldout/   # reuse a vocabulary
"""
import argparse, base64, fcntl, functools, gzip, hashlib, heapq, itertools, json, math
import multiprocessing, os, pathlib, re, resource, signal, sys, threading, time, unicodedata, zlib
from collections import Counter, defaultdict, deque

import numpy as np
import requests
import tiktoken

SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[MASK]"]
# GPT-2 style pre-tokenisation, written so Python's `re` (training) and tiktoken's Rust engine
# (encoding) split text the same way: letters, digits, other symbols, whitespace.
PATTERN = r"""'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
C4_URL = ("https://huggingface.co/datasets/allenai/c4/resolve/main/en/"
          "c4-train.{i:05d}-of-01024.json.gz")
VOCAB_SIZE = 32768  # the paper's vocabulary size
SEQ_LEN = 128  # the paper's row length: short rows are what make one day enough
TRASH = 0.3  # the paper: drop documents with more than 0.3 tokens per character (at 32k)
# English has ~0.21 tokens/char at 32k (0.212 on 105 MB of Wikipedia and books). The threshold
# is --trash x the sample's own tokens/char / 0.21: ~1.4x typical English at any vocabulary size.
TRASH_REF = 0.21
TRASH_WARN = 0.05  # dropping more than 5% of the text means the filter is hitting normal text
SAMPLE_MB = 100  # the tokenizer learns from this much text: more barely changes the merges
VAL_EVERY, VAL_CAP = 200, 1 << 20  # every 200th document is held out, up to ~1M tokens
RETRIES, BACKOFF = 5, 2.0  # download attempts and first wait (s), doubling: ~30 s of trouble
H100_DAY_TOKENS = 69e9  # 800k tokens/s (this project's H100 goal) x 86,400 s, rounded
SHARDS, C4_SHARDS = 33, 1024  # the paper's 5.5 B tokens at ~0.17 B per shard; C4 en has 1024
TASK_BYTES = 1 << 20  # text per worker task: hides the hand-over, small enough to stay flat
LIMITS = {"vocab_size": (261, 65536), "seq_len": (2, 65536), "trash": (0.01, 100),  # uint16 ids
          "sample_mb": (0.001, 1e6), "shards": (1, C4_SHARDS), "tokens": (1, 1e13),
          "workers": (1, 1024)}
OUTPUTS = ("tokenizer.tiktoken", "train.bin", "val.bin", "meta.json")  # written as name.tmp first


def die(msg):
    raise SystemExit(f"error: {msg}")


class Parser(argparse.ArgumentParser):
    """The three scripts' one flag check: a bad flag is one line naming it, never the usage.
    Every number must be finite and within its range in `limits`, every text non-empty."""

    def __init__(self, doc, limits):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.limits = limits

    def error(self, message):
        die(message)

    def parse_args(self, argv=None):
        args = super().parse_args(argv)
        for name, value in vars(args).items():
            flag = "--" + name.replace("_", "-")
            lo, hi = self.limits.get(name, (-math.inf, math.inf))
            if value == "":
                die(f"{flag}: empty")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and not (math.isfinite(value) and lo <= value <= hi):  # nan fails too
                die(f"{flag} {value}: must be in {lo:g}..{hi:g}")
        return args


def entry(main):
    """Wraps each script's main: Ctrl-C exits with 130 and an OS error (a full disk, a file that
    cannot be read or written) with one line naming the file, never with a traceback."""
    @functools.wraps(main)
    def guarded(argv=None):
        try:
            return main(argv)
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr, flush=True)
            raise SystemExit(130)
        except OSError as e:
            die(f"{e.filename or 'I/O'}: {e.strerror or e}")
    return guarded


def claim(folder, who):
    """Create `folder` and lock it until this process ends: two runs never write one folder."""
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, "lock"), "w")
    except OSError as e:
        die(f"--out {folder}: cannot write there ({e.strerror})")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        die(f"--out {folder}: another {who} is writing into it; wait for it or use another --out")
    return lock


class Progress:
    """The one progress line of every long step, at most every `every` seconds, on stderr:
    Progress("tokenize", 105, "MB")(52.5) -> 'tokenize: 52.5/105.0 MB, 2.6 MB/s, ETA 0:20'."""

    def __init__(self, what, total=0, unit="", every=2.0):
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.t0 = self.last = time.time()

    def __call__(self, done, extra="", force=False):
        now = time.time()
        if not force and now - self.last < self.every:
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        line = f"{self.what}: {done:,.1f}" + (f"/{self.total:,.1f}" if self.total else "")
        line += f" {self.unit}, {rate:,.1f} {self.unit}/s"
        if self.total:
            left = int((self.total - done) / rate) if rate > 0 else 0
            line += f", ETA {left // 60}:{left % 60:02d}"
        print(line + extra, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- download
def download(url, path):
    """Stream url to path.part, resume it with a Range request, rename when complete. Server
    errors and cut transfers are retried, each retry said in one line; a 404 is not retried."""
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    part = path + ".part"
    for attempt in range(1, RETRIES + 1):
        have = os.path.getsize(part) if os.path.exists(part) else 0
        try:
            with requests.get(url, stream=True, timeout=(10, 60),
                              headers={"Range": f"bytes={have}-"} if have else {}) as r:
                if r.status_code == 416 and have:  # the .part already holds everything
                    os.replace(part, path)
                    return path
                if r.status_code not in (200, 206):
                    err = f"HTTP {r.status_code}"
                    if r.status_code < 500 and r.status_code != 429:
                        break  # 404 and friends will not get better by retrying
                else:
                    have = have if r.status_code == 206 else 0  # 200: Range ignored, start over
                    total = have + int(r.headers.get("Content-Length", 0))
                    progress = Progress(f"download {os.path.basename(path)}", total / 1e6, "MB")
                    with open(part, "ab" if have else "wb") as f:
                        for block in r.iter_content(1 << 16):
                            f.write(block)
                            progress(f.tell() / 1e6)
                    if os.path.getsize(part) >= total:
                        os.replace(part, path)
                        return path
                    err = f"truncated: {os.path.getsize(part):,} of {total:,} bytes"
        except (requests.RequestException, OSError) as e:
            err = f"{type(e).__name__}: {str(e)[:200]}"
        if attempt < RETRIES:
            wait = BACKOFF * 2 ** (attempt - 1)
            print(f"download {url}: {err} (attempt {attempt} of {RETRIES}); waiting {wait:g}s",
                  file=sys.stderr, flush=True)
            time.sleep(wait)
    die(f"download failed: {url}: {err}")


class Shards:
    """C4 shards in `folder`, in order: while shard i is in use, shard i + 1 downloads in a thread,
    so a run takes about max(download, processing); a rerun resumes the downloads (.part files)."""

    def __init__(self, folder, count):
        self.folder, self.count, self.threads, self.errors, self.waited = folder, count, {}, {}, 0

    def path(self, i):
        return os.path.join(self.folder, f"c4-train.{i:05d}.json.gz")

    def fetch(self, i):
        try:
            download(C4_URL.format(i=i), self.path(i))
        except (SystemExit, OSError) as e:  # handed over to the main thread by __iter__
            self.errors[i] = str(e)

    def __iter__(self):
        i = 0
        while i < self.count:  # not range(): c4_sources() may lower the count on the way
            for j in (i, i + 1):
                if j < self.count and j not in self.threads:
                    self.threads[j] = threading.Thread(target=self.fetch, args=(j,), daemon=True)
                    self.threads[j].start()
            t0 = time.time()
            self.threads[i].join()
            self.waited += time.time() - t0
            if i in self.errors:
                die(f"{self.path(i)}: {self.errors[i].removeprefix('error: ')}")
            yield self.path(i)
            i += 1


# ----------------------------------------------------------------------------- reading
NON_ASCII = re.compile(r"[^\x00-\x7f]+")


def strip_marks(match):
    return "".join(c for c in match.group() if unicodedata.category(c) != "Mn")


def normalize(text):
    """NFD, drop combining marks (accents), lowercase, collapse whitespace: the paper's cleaning.
    Only the non-ASCII runs are looked at character by character: ~30x faster than a regex of
    all ~2,000 marks over the text, with the same output."""
    if not text.isascii():
        text = NON_ASCII.sub(strip_marks, unicodedata.normalize("NFD", text))
    return " ".join(text.lower().split())


def input_files(paths):
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs
                            if f.endswith((".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".json.gz")))
        elif os.path.isfile(p):
            files.append(p)
        else:
            die(f"input not found: {p}")
    if not files:
        die(f"no .txt/.jsonl/.json.gz files in {' '.join(paths)}")
    return files


def documents(path):
    """(path:line, is_json, raw bytes) of each document of one file: a .json* line, or a
    blank-line separated .txt paragraph; the workers decode them. A corrupt file stops the run."""
    is_json, para, start = ".json" in os.path.basename(path), [], 0
    with open(path, "rb") as raw:
        f = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
        try:
            for lineno, line in enumerate(itertools.chain(f, [b""]), 1):  # b"": ends the last
                line = line.strip()
                if line:
                    start = start if para else lineno
                    para.append(line)
                if para and (is_json or not line):  # a .json* line, or a paragraph, is complete
                    yield f"{path}:{start}", is_json, b" ".join(para)
                    para = []
        except (OSError, EOFError, zlib.error) as e:
            die(f"{path}: corrupt or truncated file ({e})")


def tasks(files):
    """The documents of the files, in order, in tasks of ~TASK_BYTES. A task ends with its file,
    so no shard is read before it is needed."""
    for path in files:
        batch, size = [], 0
        for rec in documents(path):
            batch.append(rec)
            size += len(rec[2])
            if size >= TASK_BYTES:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch


ENCODERS = {}  # in each worker (a pool per run): the run's tokenizer, read once from its file


def work(recs, tok, limit):
    """The per-document work, in a worker: parse, normalise, hash; then count pre-tokenised
    chunks (no tokenizer yet: the tokenizer sample) or encode and check for trash. Returns
    [(hash, characters, ids | token count if trash | None) or (None, where, why)], Counter."""
    if tok and tok["file"] not in ENCODERS:
        with open(tok["file"]) as f:
            ENCODERS[tok["file"]] = load_tokenizer(dict(tok, ranks=f.read()))
    results, counts = [], Counter()
    for where, is_json, raw in recs:
        try:
            doc = json.loads(raw) if is_json else {"text": raw.decode("utf-8")}
        except ValueError as e:  # broken JSON or UTF-8
            results.append((None, where, f"{type(e).__name__}: {str(e)[:80]}"))
            continue
        text = doc.get("text") if isinstance(doc, dict) else None
        if not isinstance(text, str):
            results.append((None, where, 'no string "text" field'))
            continue
        text = normalize(text)
        key = hashlib.blake2b(text.encode(), digest_size=8).digest()
        if tok:
            ids = ENCODERS[tok["file"]].encode_ordinary(text)
            is_trash = len(ids) > limit * len(text)
            results.append((key, len(text), len(ids) if is_trash else np.array(ids, np.uint16)))
        else:
            counts.update(re.findall(PATTERN, text))
            results.append((key, len(text), None))
    return results, counts


def ordered(pool, files, workers, tok=None, limit=0.0):
    """(records, work(records, tok, limit)) for the tasks of the files, in order, with at most 2
    tasks per worker in flight so memory stays flat (Pool.imap would read all its input ahead)."""
    pending = deque()
    for recs in tasks(files):
        pending.append((recs, pool.apply_async(work, (recs, tok, limit))))
        if len(pending) >= 2 * workers:
            recs, result = pending.popleft()
            yield recs, result.get()
    while pending:
        recs, result = pending.popleft()
        yield recs, result.get()


# ----------------------------------------------------------------------------- tokenizer
def train_bpe(counts, n_vocab):
    """Byte-level BPE on pre-tokenised chunk counts: merge the most frequent pair of adjacent
    tokens into a new token, again and again, e.g. ids=[1, 2, 3, 1, 2], pair=(1, 2), idx=4 ->
    [4, 3, 4]; ties go to the smaller pair. Returns {token bytes: rank} in merge order.
    For speed a chunk is a str of one character per token, so a merge is str.replace; only
    the chunks holding the pair are touched (`where`), pair counts change by their net delta,
    and a heap, its stale entries skipped, finds the next best pair."""
    words, freq = ["".join(map(chr, w.encode())) for w in counts], list(counts.values())
    pairs, where = defaultdict(int), defaultdict(set)
    for i, w in enumerate(words):
        for j in range(len(w) - 1):
            pairs[w[j:j + 2]] += freq[i]
            where[w[j:j + 2]].add(i)
    heap = [(-c, p) for p, c in pairs.items()]  # 2-char strs order like pairs of ints
    heapq.heapify(heap)
    vocab = [bytes([b]) for b in range(256)]
    progress = Progress("tokenizer", n_vocab - 256, "merges")
    while len(vocab) < n_vocab and heap:
        c, p = heapq.heappop(heap)
        if -c != pairs.get(p):
            continue  # stale heap entry
        if -c < 2:
            break  # nothing left that repeats: a smaller vocabulary is all this text supports
        new, delta = chr(len(vocab)), defaultdict(int)
        vocab.append(vocab[ord(p[0])] + vocab[ord(p[1])])
        for i in where.pop(p):
            w, f = words[i], freq[i]
            out = w.replace(p, new)
            if len(out) == len(w):
                continue  # `where` still names chunks that an earlier merge took the pair from
            for j in range(len(w) - 1):
                delta[w[j:j + 2]] -= f
            for j in range(len(out) - 1):
                q = out[j:j + 2]
                delta[q] += f
                if new in q:
                    where[q].add(i)
            words[i] = out
        del pairs[p]
        for q, d in delta.items():
            if d and q != p:  # a pair down to 0 stays: it never comes back
                pairs[q] += d
                heapq.heappush(heap, (-pairs[q], q))
        progress(len(vocab) - 256)
    return {b: i for i, b in enumerate(vocab)}


def load_tokenizer(tok):
    """tiktoken.Encoding from the dict in meta.json / checkpoints (ranks as rank-file text)."""
    pairs = (line.split() for line in tok["ranks"].splitlines())
    ranks = {base64.b64decode(token): int(rank) for token, rank in pairs}
    return tiktoken.Encoding("cram", pat_str=tok["pattern"], mergeable_ranks=ranks,
                             special_tokens=tok["special_tokens"])


def make_tokenizer(pool, files, args, times):
    """(tokenizer dict, its tokens per character) trained on the first --sample-mb of normalised,
    deduplicated text. Workers count the chunks of whole tasks; the few documents they should not
    have counted (duplicates, those past the sample) are taken back here."""
    counts, seen, chars, limit = Counter(), set(), 0, args.sample_mb * 1e6
    progress, t0 = Progress("tokenizer sample", args.sample_mb, "MB"), time.time()
    for recs, (results, part) in ordered(pool, files, args.workers):
        for rec, (key, n, _) in zip(recs, results):
            if key and (chars >= limit or key in seen):
                part.subtract(work([rec], None, 0)[1])  # what the worker counted for it
            elif key:
                seen.add(key)
                chars += n
        counts.update(+part)  # +: without the chunks taken back to 0
        progress(chars / 1e6)
        if chars >= limit:
            break
    if not counts:
        die(f"no text in {' '.join(args.input or ['the C4 shards'])}")
    times["tokenizer_count"], t0 = time.time() - t0, time.time()
    ranks = train_bpe(counts, args.vocab_size - len(SPECIALS))
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()]
    specials = {s: len(ranks) + i for i, s in enumerate(SPECIALS)}
    tok = {"ranks": "".join(lines), "pattern": PATTERN, "special_tokens": specials}
    enc = load_tokenizer(tok)  # the sample's tokens per character set the trash threshold
    tokens = sum(n * len(enc.encode_ordinary(chunk)) for chunk, n in counts.items())
    times["tokenizer_train"] = time.time() - t0
    print(f"tokenizer: {len(ranks) + len(SPECIALS):,} tokens from {chars / 1e6:,.1f} MB in "
          f"{times['tokenizer_count'] + times['tokenizer_train']:.0f}s", file=sys.stderr)
    return tok, tokens / chars


def read_prepared(folder):
    """(meta, tokenizer dict, {"train", "val": read-only (N, seq_len) memmaps}) of a folder written
    by prepare.py; sizes are checked against meta.json, so a damaged .bin is named at start-up."""
    try:
        meta = json.loads(pathlib.Path(folder, "meta.json").read_text())
        ranks = pathlib.Path(folder, meta["tokenizer_file"]).read_text()
        tok = {"ranks": ranks, "pattern": meta["pattern"], "special_tokens": meta["special_tokens"]}
        rows = {}
        for split in ("train", "val"):
            path = os.path.join(folder, f"{split}.bin")
            size = os.path.getsize(path) if os.path.exists(path) else None
            if size != meta[split]["bytes"]:
                die(f"{path}: {'missing' if size is None else f'{size:,} bytes'}, but meta.json "
                    f"says {meta[split]['bytes']:,}: damaged; run prepare.py again")
            rows[split] = np.memmap(path, dtype=np.uint16, mode="r").reshape(-1, meta["seq_len"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        die(f"{folder}: no prepared data ({type(e).__name__}: {e}); run prepare.py --out {folder}")
    return meta, tok, rows


def reuse_tokenizer(folder):
    """(tokenizer dict, tokens per character of its sample) of an earlier output folder."""
    meta, tok, _ = read_prepared(folder)
    path = os.path.join(folder, meta["tokenizer_file"])
    try:
        load_tokenizer(tok)
    except (ValueError, KeyError, TypeError) as e:
        die(f"{path}: unreadable ({type(e).__name__}: {str(e)[:80]}); run prepare.py again")
    n_vocab = len(tok["ranks"].splitlines()) + len(tok["special_tokens"])
    if n_vocab != meta["vocab_size"]:
        die(f"{path}: {n_vocab} tokens, but meta.json says {meta['vocab_size']}: damaged; "
            "run prepare.py again")
    return tok, meta.get("sample_tokens_per_char") or 1 / meta["chars_per_token"]


# ----------------------------------------------------------------------------- packing
class Packer:
    """Appends documents, each followed by [SEP], to path.tmp as whole uint16 rows; the rest
    waits for the next documents, and the last rest is dropped."""

    def __init__(self, path, seq_len, sep):
        self.L, self.sep = seq_len, np.array([sep], np.uint16)
        self.f, self.sha = open(path + ".tmp", "wb"), hashlib.sha256()
        self.rest, self.rows = np.zeros(0, np.uint16), 0

    def add(self, docs):
        parts = [self.rest]
        for ids in docs:
            parts += [ids, self.sep]
        flat = np.concatenate(parts)
        n = len(flat) // self.L * self.L
        self.f.write(flat[:n].tobytes())
        self.sha.update(flat[:n].tobytes())
        self.rest, self.rows = flat[n:], self.rows + n // self.L

    def close(self):
        self.f.close()
        return {"rows": self.rows, "tokens": self.rows * self.L, "bytes": self.rows * self.L * 2,
                "sha256": self.sha.hexdigest()}


def encode(pool, sources, tok, limit, args, stats):
    """The main process's part of encoding, in document order: exact deduplication, the held-out
    split (every VAL_EVERY-th kept document, and the first ones until val has a row), packing.
    `sources` gives lists of files, each asked for when the last is done; counts go to `stats`."""
    seen, s, sep = set(), stats, tok["special_tokens"]["[SEP]"]
    train = Packer(os.path.join(args.out, "train.bin"), args.seq_len, sep)
    val = Packer(os.path.join(args.out, "val.bin"), args.seq_len, sep)
    progress = Progress("encode", 0, "MB of text")
    for files in sources:
        for _, (results, _) in ordered(pool, files, args.workers, tok, limit):
            to_train, to_val = [], []
            for key, n, ids in results:
                if key is None:  # a bad line: n says where, ids why
                    s["bad_lines"] += 1
                    if s["bad_lines"] <= 5:
                        print(f"warning: {n}: skipped ({ids})", file=sys.stderr)
                    continue
                s["documents_read"] += 1
                if not n or key in seen:
                    s["duplicates_dropped" if n else "empty_dropped"] += 1
                    s["duplicate_chars_dropped"] += n
                    continue
                seen.add(key)
                if isinstance(ids, int):
                    s.update(trash_dropped=1, trash_chars_dropped=n)
                    continue
                if s["val_tokens"] < VAL_CAP and (s["documents"] % VAL_EVERY == 0
                                                  or s["val_tokens"] < args.seq_len):
                    to_val.append(ids)
                    s["val_tokens"] += len(ids) + 1
                else:
                    to_train.append(ids)
                s.update(documents=1, characters=n, tokens=len(ids))
            train.add(to_train)
            val.add(to_val)
            progress(s["characters"] / 1e6)
    return train.close(), val.close()


def c4_sources(shards, stats, tokens):
    """[shard] after shard for encode(); with --tokens, shard 0 tells how many are needed."""
    for i, path in enumerate(shards):
        yield [path]
        if i == 0 and tokens:
            shards.count = min(C4_SHARDS, math.ceil(tokens / max(stats["tokens"], 1)))
            print(f"--tokens {tokens:g}: shard 0 gave {stats['tokens']:,} tokens "
                  f"({stats['tokens'] / os.path.getsize(shards.path(0)):.2f} per byte of gzip), "
                  f"so {shards.count} shards", file=sys.stderr)


# ----------------------------------------------------------------------------- main
def parse_args(argv):
    ap = Parser(__doc__, {})
    arg = ap.add_argument
    arg("--input", nargs="+", help=".txt (blank-line separated paragraphs), .jsonl, .json.gz, "
        ".gz of them, or folders of them; default: download C4 shards")
    arg("--shards", type=int, help=f"C4 shards to download (default {SHARDS}; see the table)")
    arg("--tokens", type=float, help="instead of --shards: enough shards for this many tokens, "
        "as shard 0 estimates (e.g. 69e9: an H100 day)")
    arg("--out", default="data", help="output folder (%(default)s), swapped in when complete")
    arg("--vocab-size", type=int, default=VOCAB_SIZE, help="tokens incl. 4 specials (%(default)s)")
    arg("--seq-len", type=int, default=SEQ_LEN, help="tokens per packed row (%(default)s)")
    arg("--trash", type=float, default=TRASH, help="drop documents of more than trash tokens per "
        "character at 32k (%(default)s); scaled by the sample's tokens/char at other sizes")
    arg("--sample-mb", type=float, default=SAMPLE_MB, help="tokenizer sample (%(default)s MB)")
    arg("--tokenizer", help="reuse the tokenizer of an earlier output folder instead of training")
    arg("--workers", type=int, default=os.cpu_count() or 1, help="processes (%(default)s)")
    args = ap.parse_args(argv)
    for name, (lo, hi) in LIMITS.items():
        value = getattr(args, name)
        if value is not None and not lo <= value <= hi:
            die(f"--{name.replace('_', '-')} {value:g}: must be in {lo:g}..{hi:g}")
    if args.input and (args.tokens or args.shards):
        die("--tokens and --shards choose C4 shards: not with --input")
    if args.tokens and args.shards:
        die("--tokens picks the number of shards: give it or --shards, not both")
    return args


def build(args, pool, files, times):
    """Tokenizer, encoding and packing, all written under .tmp names; returns meta."""
    count = C4_SHARDS if args.tokens else args.shards or SHARDS  # --tokens: shard 0 will tell
    shards = None if files else Shards(os.path.join(args.out, "raw"), count)
    if args.tokenizer:
        tok, per_char = reuse_tokenizer(args.tokenizer)
    else:
        tok, per_char = make_tokenizer(pool, files or shards, args, times)
    tok_file = os.path.join(args.out, "tokenizer.tiktoken.tmp")
    pathlib.Path(tok_file).write_text(tok["ranks"])
    spec = dict(tok, ranks=None, file=tok_file)  # the workers read the ranks from the file
    limit, stats, t0 = args.trash * per_char / TRASH_REF, Counter(), time.time()
    sources = [files] if files else c4_sources(shards, stats, args.tokens)
    train, val = encode(pool, sources, spec, limit, args, stats)
    if shards:
        times["download_wait"] = shards.waited
    times["encode_pack"] = time.time() - t0
    if not train["rows"] or not val["rows"]:
        die(f"too little data: {stats['tokens']:,} tokens make {train['rows']} train and "
            f"{val['rows']} val rows of {args.seq_len}; give more text")
    return {
        "format": "cram-data-1", "vocab_size": len(tok["ranks"].splitlines()) + len(SPECIALS),
        "seq_len": args.seq_len, "dtype": "uint16", "special_tokens": tok["special_tokens"],
        "pattern": tok["pattern"], "tokenizer_file": "tokenizer.tiktoken",
        "normalization": "NFD, strip combining marks (accents), lowercase, collapse whitespace",
        "trash": args.trash, "trash_tokens_per_char": round(limit, 6),
        "sample_tokens_per_char": round(per_char, 6), "documents": stats["documents"],
        "characters": stats["characters"], "tokens": stats["tokens"],
        "chars_per_token": round(stats["characters"] / stats["tokens"], 4),
        "filters": {k: stats[k] for k in ("documents_read", "bad_lines", "empty_dropped",
                    "duplicates_dropped", "duplicate_chars_dropped", "trash_dropped",
                    "trash_chars_dropped")},
        "train": train, "val": val,
        "sources": files or [shards.path(i) for i in range(shards.count)]}


def publish(out, meta):
    """Swap the new files in, once all are on disk: the old meta.json goes first (it must never
    vouch for new files), then the renames, meta.json last: it says that the folder is complete."""
    pathlib.Path(out, "meta.json.tmp").write_text(json.dumps(meta, indent=1))
    os.sync()
    if os.path.exists(os.path.join(out, "meta.json")):
        os.remove(os.path.join(out, "meta.json"))
    for name in OUTPUTS:  # meta.json is the last
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def report(meta, args, times, t_start):
    f, chars = meta["filters"], meta["characters"]
    print(f"documents: {f['documents_read']:,} read, {f['bad_lines']} bad lines, "
          f"{f['empty_dropped']} empty, {f['duplicates_dropped']:,} duplicates "
          f"({f['duplicate_chars_dropped']:,} chars), {f['trash_dropped']:,} trash "
          f"({f['trash_chars_dropped']:,} chars) dropped; {meta['documents']:,} kept")
    if f["trash_chars_dropped"] > TRASH_WARN * (chars + f["trash_chars_dropped"]):
        print(f"WARNING: the trash filter dropped {f['trash_chars_dropped']:,} of "
              f"{chars + f['trash_chars_dropped']:,} characters; if that is normal text, raise "
              f"--trash (now {args.trash:g})", file=sys.stderr)
    print(f"tokens: {meta['tokens']:,} ({meta['chars_per_token']:.2f} chars/token) -> "
          f"{meta['train']['rows']:,} train rows, {meta['val']['rows']:,} val rows of "
          f"{args.seq_len} in {args.out}/; an H100 day at 800k tokens/s reads "
          f"{H100_DAY_TOKENS / meta['tokens']:,.1f}x that (see --help)")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()) +
          f", total {time.time() - t_start:.1f}s; peak memory {peak:,.0f} MB (main process)")


def main(argv=None):
    args = parse_args(argv)
    t_start, times = time.time(), {}
    files = input_files(args.input) if args.input else None
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        die(f"--out {args.out}: cannot write there ({e.strerror})")
    # One pool for the whole run, started before any download thread (forking is then safe).
    # Workers ignore Ctrl-C: the main process stops them, without a traceback from each.
    pool = multiprocessing.Pool(args.workers, signal.signal, (signal.SIGINT, signal.SIG_IGN))
    try:
        meta = build(args, pool, files, times)
        publish(args.out, meta)
    except OSError as e:  # a full disk, say: one line, and the earlier folder is left as it was
        die(f"{e.filename or args.out}: cannot write ({e.strerror})")
    finally:
        pool.terminate()
        for name in OUTPUTS:  # what a failed run left behind
            if os.path.exists(os.path.join(args.out, name + ".tmp")):
                os.remove(os.path.join(args.out, name + ".tmp"))
    report(meta, args, times, t_start)
    return meta


if __name__ == "__main__":
    main()
