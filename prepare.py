"""prepare.py: raw English text -> a BPE tokenizer trained on it -> packed, memmapped rows.
    python prepare.py                              # download C4 shards, write data/
    python prepare.py --input corpus.jsonl.gz      # or use local files, fully offline
    python prepare.py --input more.txt --tokenizer data/ --out heldout/   # reuse a vocabulary

C4 shards (~0.17 B tokens, ~320 MB of gzip each) for a day that reads each token once:
    the paper's GPU at the v2 pace     5.5 B tokens/day     33 shards (the default)
    an H100 at 800k tokens/s            69 B tokens/day    406 shards
"""
import argparse, base64, fcntl, functools, gzip, hashlib, heapq, itertools, json, math
import multiprocessing, os, pathlib, re, signal, sys, threading, time, unicodedata, zlib
from collections import Counter, defaultdict, deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests, tiktoken

SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[MASK]"]
# GPT-2 style pre-tokenisation that Python's `re` (training) and tiktoken (encoding) split alike
PATTERN = r"""'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
C4_URL = ("https://huggingface.co/datasets/allenai/c4/resolve/main/en/"
          "c4-train.{i:05d}-of-01024.json.gz")
VOCAB_SIZE = 32768  # the paper's vocabulary size
SEQ_LEN = 128  # the paper's row length: short rows are what make one day enough
TRASH = 0.3  # the paper: drop documents with more than 0.3 tokens per character (at 32k)
TRASH_REF = 0.21  # English at 32k (0.212 on 105 MB of Wikipedia and books); the threshold is
# --trash x the sample's own tokens/char / 0.21: ~1.4x typical English at any vocabulary size
TRASH_WARN = 0.05  # dropping more than 5% of the text means the filter is hitting normal text
SAMPLE_MB = 100  # the tokenizer learns from this much text: more barely changes the merges
VAL_EVERY, VAL_CAP = 200, 1 << 20  # every 200th document is held out, up to ~1M tokens
RETRIES, BACKOFF = 5, 2.0  # download attempts and first wait (s), doubling: ~30 s of trouble
SHARDS, C4_SHARDS = 33, 1024  # the paper's 5.5 B tokens at ~0.17 B per shard; C4 en has 1024
TASK_BYTES = 1 << 20  # text per worker task: hides the hand-over, small enough to stay flat
LIMITS = {"vocab_size": (261, 65536), "seq_len": (2, 65536), "trash": (0.01, 100),  # uint16 ids
          "sample_mb": (0.001, 1e6), "shards": (1, C4_SHARDS), "workers": (1, 1024)}
# Ours beside meta.json: data files named by 8 hex of their sha256 (never overwritten), and .tmp
OURS = re.compile(r"(train|val|tokenizer)(-[0-9a-f]{8}\.(bin|tiktoken)|\.tmp)|meta\.json\.tmp")


# ----------------------------------------------------------------------------- shared pieces
def die(msg):
    raise SystemExit(f"error: {msg}")


class Parser(argparse.ArgumentParser):
    """A bad flag is one line naming it: numbers finite and within `limits`, texts non-empty."""

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
            if type(value) in (int, float) and not (math.isfinite(value) and lo <= value <= hi):
                die(f"{flag} {value}: must be in {lo}..{hi}")
        return args


def entry(main):
    """Ctrl-C exits with 130, an OS error (a full disk, an unreadable file) is one line."""
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
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        die(f"--out {folder}: another {who} is writing into it; wait for it or use another --out")
    except OSError as e:
        die(f"--out {folder}: cannot write there ({e.strerror})")
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
def download(url, path, stop=None):
    """url -> path.part -> path, retried (each retry said); setting the event `stop` ends it."""
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    stop = stop or threading.Event()
    for attempt in range(1, RETRIES + 1):
        try:
            with requests.get(url, stream=True, timeout=(10, 60)) as r:
                if 400 <= r.status_code < 500 and r.status_code != 429:  # will not get better
                    die(f"download failed: {url}: HTTP {r.status_code}")
                if r.status_code != 200:
                    raise requests.HTTPError(f"HTTP {r.status_code}")
                with open(path + ".part", "wb") as f:  # each try starts it from zero
                    for block in r.iter_content(1 << 16):  # a cut transfer raises
                        if stop.is_set():
                            raise KeyboardInterrupt
                        f.write(block)
            os.replace(path + ".part", path)
            return path
        except (requests.RequestException, OSError) as e:
            err = str(e)[:200]
        wait = BACKOFF * 2 ** (attempt - 1)
        if attempt < RETRIES:
            print(f"download {url}: {err} (attempt {attempt} of {RETRIES}); waiting {wait:g}s",
                  file=sys.stderr, flush=True)
            if stop.wait(wait):  # Ctrl-C in the main thread
                raise KeyboardInterrupt
    die(f"download failed: {url}: {err}")


def c4_shards(out, count, fetcher, stop):
    """The first `count` C4 shards in order; shard i + 1 downloads (`fetcher`) while i is read."""
    path = os.path.join(out, "raw", "c4-train.{i:05d}.json.gz")
    ahead = fetcher.submit(download, C4_URL.format(i=0), path.format(i=0), stop)
    for i in range(1, count + 1):
        done = ahead.result()  # a failed download raises its one-line error here
        if i < count:
            ahead = fetcher.submit(download, C4_URL.format(i=i), path.format(i=i), stop)
        yield done


# ----------------------------------------------------------------------------- reading (workers)
NON_ASCII = re.compile(r"[^\x00-\x7f]+")


def strip_marks(match):
    return "".join(c for c in match.group() if unicodedata.category(c) != "Mn")


def normalize(text):
    """The paper's cleaning: NFD, drop accents, lowercase, collapse whitespace. Only non-ASCII runs
    are looked at per character: ~30x faster than a regex of all ~2,000 marks."""
    if not text.isascii():
        text = NON_ASCII.sub(strip_marks, unicodedata.normalize("NFD", text))
    return " ".join(text.lower().split())


def tasks(files):
    """(is_json, bytes) of each .json* line or .txt paragraph, in tasks that end with their file."""
    for path in files:
        is_json, para, task, size = ".json" in os.path.basename(path), [], [], 0
        with open(path, "rb") as raw:
            f = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
            try:
                for line in itertools.chain(f, [b""]):  # b"": ends the last paragraph
                    line = line.strip()
                    if line:
                        para.append(line)
                    if para and (is_json or not line):
                        task.append((is_json, b" ".join(para)))
                        size, para = size + len(task[-1][1]), []
                    if size >= TASK_BYTES:
                        yield task
                        task, size = [], 0
            except (OSError, EOFError, zlib.error) as e:
                die(f"{path}: corrupt or truncated file ({e})")
        if task:
            yield task


ENCODERS = {}  # in each worker (a pool per run): the run's tokenizer, read once from its file


def work(recs, tok):
    """In a worker: per document None (no text) or (hash, characters, ids); without a tokenizer
    (the tokenizer sample) no ids but the chunk counts of the whole task, sent once, not per doc."""
    if tok and tok["file"] not in ENCODERS:
        ranks = pathlib.Path(tok["file"]).read_text()
        ENCODERS[tok["file"]] = load_tokenizer(dict(tok, ranks=ranks))
    results, counts = [], Counter()
    for is_json, raw in recs:
        try:
            doc = json.loads(raw) if is_json else {"text": raw.decode("utf-8")}
        except ValueError:  # broken JSON or UTF-8
            doc = None
        text = doc.get("text") if isinstance(doc, dict) else None
        text = normalize(text) if isinstance(text, str) else ""
        if not text:
            results.append(None)
            continue
        key = hashlib.blake2b(text.encode(), digest_size=8).digest()
        if tok:
            results.append((key, len(text), np.array(ENCODERS[tok["file"]].encode_ordinary(text),
                                                     np.uint16)))
        else:
            counts.update(re.findall(PATTERN, text))
            results.append((key, len(text), None))
    return results, counts


def ordered(pool, files, workers, tok, s):
    """Each task's new documents [(characters, ids, record)] in order, deduplicated, and its chunk
    counts without the duplicates' (the tokenizer sample); s counts the rest."""
    handed_out = ((recs, pool.apply_async(work, (recs, tok))) for recs in tasks(files))
    pending, seen = deque(itertools.islice(handed_out, 2 * workers)), set()
    while pending:  # at most 2 tasks per worker in flight: Pool.imap would read all ahead
        recs, job = pending.popleft()
        results, counts = job.get()
        pending.extend(itertools.islice(handed_out, 1))  # the next task takes its place
        docs = []
        for rec, result in zip(recs, results):
            if result is None:
                s["bad_lines"] += 1
            elif result[0] in seen:
                s["duplicates_dropped"] += 1
                if not tok:  # the worker counted it: take it back
                    counts.subtract(work([rec], None)[1])
            else:
                seen.add(result[0])
                docs.append((*result[1:], rec))
        yield docs, counts


# ----------------------------------------------------------------------------- tokenizer
def train_bpe(counts, n_vocab):
    """Byte-level BPE: merge the most frequent pair of adjacent tokens into a new one, again and
    again, e.g. ids=[1, 2, 3, 1, 2], pair=(1, 2), idx=4 -> [4, 3, 4]; ties go to the smaller pair.
    For speed a chunk is a str of a char per token, a merge str.replace; a heap finds the best."""
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


def make_tokenizer(pool, files, args):
    """(tokenizer dict, its tokens per character) from the first --sample-mb of new documents."""
    counts, chars, limit = Counter(), 0, args.sample_mb * 1e6
    progress = Progress("tokenizer sample", args.sample_mb, "MB")
    for docs, part in ordered(pool, files, args.workers, None, Counter()):
        for n, _, rec in docs:
            if chars >= limit:  # past the sample: take back what the worker counted
                part.subtract(work([rec], None)[1])
            else:
                chars += n
        counts.update(+part)  # +: without the chunks taken back to zero
        progress(chars / 1e6)
        if chars >= limit:
            break
    if not counts:
        die(f"no text in {' '.join(args.input or ['the C4 shards'])}")
    ranks = train_bpe(counts, args.vocab_size - len(SPECIALS))
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()]
    specials = {s: len(ranks) + i for i, s in enumerate(SPECIALS)}
    tok = {"ranks": "".join(lines), "pattern": PATTERN, "special_tokens": specials}
    enc = load_tokenizer(tok)  # the sample's tokens per character set the trash threshold
    return tok, sum(n * len(enc.encode_ordinary(c)) for c, n in counts.items()) / chars


# ----------------------------------------------------------------------------- the prepared folder
def expect(ok, path, why):
    if not ok:
        die(f"{path}: {why}; run prepare.py again")


def read_prepared(folder):
    """(meta, tokenizer dict, {"train", "val": memmaps}): the one check of a folder's files."""
    where = os.path.join(folder, "meta.json")
    if not os.path.isfile(where):
        die(f"{folder}: no prepared data (no meta.json); run prepare.py --out {folder}")
    try:
        meta = json.loads(pathlib.Path(where).read_text())
        vocab, specials = meta["vocab_size"], meta["special_tokens"]
        bins = {split: (meta[split]["file"], meta[split]["bytes"]) for split in ("train", "val")}
        where = os.path.join(folder, meta["tokenizer_file"])
        tok = {"ranks": pathlib.Path(where).read_text(), "pattern": meta["pattern"],
               "special_tokens": specials}
        load_tokenizer(tok)  # its ranks must parse
        n = len(tok["ranks"].splitlines()) + len(specials)
        expect(n == vocab and max(specials.values()) < n, where, f"{n} tokens (specials "
               f"{min(specials.values())}..{max(specials.values())}), but meta.json says {vocab}")
        rows = {}
        for split, (name, size) in bins.items():
            where = os.path.join(folder, name)
            have = os.path.getsize(where)
            expect(have == size, where, f"{have:,} bytes, but meta.json says {size:,}: damaged")
            rows[split] = np.memmap(where, dtype=np.uint16, mode="r").reshape(-1, meta["seq_len"])
        top = int(rows["val"].max())  # cheap: val is at most VAL_CAP tokens
        expect(top < vocab, where, f"holds token {top}, but meta.json says vocab_size {vocab}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        expect(False, where, "missing" if isinstance(e, FileNotFoundError) else
               f"unreadable ({type(e).__name__}: {str(e)[:80]})")
    return meta, tok, rows


def seal(f, name):
    """Sync f to the disk, then rename it to `name`: a reader sees all of it or nothing."""
    f.flush()
    os.fsync(f.fileno())
    f.close()
    os.replace(f.name, os.path.join(os.path.dirname(f.name), name))
    return name


def sweep(out):
    """Remove our files that out/meta.json does not name: an old version, a failed run's files."""
    try:
        meta = json.loads(pathlib.Path(out, "meta.json").read_text())
        keep = {meta["tokenizer_file"], meta["train"]["file"], meta["val"]["file"]}
    except (OSError, ValueError, KeyError, TypeError):
        keep = set()  # no usable meta.json: nothing here is data
    for name in os.listdir(out):
        if OURS.fullmatch(name) and name not in keep:
            os.remove(os.path.join(out, name))


# ----------------------------------------------------------------------------- packing
class Packer:
    """Token arrays, in whole rows of seq_len, to out/kind.tmp; the last rest is dropped."""

    def __init__(self, out, kind, seq_len):
        self.kind, self.L, self.rest = kind, seq_len, np.zeros(0, np.uint16)
        self.f, self.sha = open(os.path.join(out, kind + ".tmp"), "wb"), hashlib.sha256()

    def add(self, parts):
        flat = np.concatenate([self.rest, *parts])
        n = len(flat) // self.L * self.L
        self.f.write(flat[:n].tobytes())
        self.sha.update(flat[:n].tobytes())
        self.rest = flat[n:]

    def close(self):  # -> its entry in meta.json; named after its content: train-1f2e3d4c.bin
        rows, name = self.f.tell() // (2 * self.L), f"{self.kind}-{self.sha.hexdigest()[:8]}.bin"
        return {"file": seal(self.f, name), "rows": rows, "bytes": rows * self.L * 2}


def encode(pool, files, tok, limit, args):
    """Per document: the trash filter, then val (every VAL_EVERY-th, and until val has a row)."""
    s, sep = Counter(), np.array([tok["special_tokens"]["[SEP]"]], np.uint16)
    train, val = (Packer(args.out, kind, args.seq_len) for kind in ("train", "val"))
    progress = Progress("encode", 0, "MB of text")
    for docs, _ in ordered(pool, files, args.workers, tok, s):
        to_train, to_val = [], []
        for n, ids, _ in docs:
            if len(ids) > limit * n:
                s.update(trash_dropped=1, trash_chars_dropped=n)
                continue
            if s["val_tokens"] < VAL_CAP and (s["documents"] % VAL_EVERY == 0
                                              or s["val_tokens"] < args.seq_len):
                to_val += [ids, sep]
                s["val_tokens"] += len(ids) + 1
            else:
                to_train += [ids, sep]
            s.update(documents=1, characters=n, tokens=len(ids))
        train.add(to_train)
        val.add(to_val)
        progress(s["characters"] / 1e6)
    return train.close(), val.close(), s


# ----------------------------------------------------------------------------- main
def parse_args(argv):
    ap = Parser(__doc__, LIMITS)
    arg = ap.add_argument
    arg("--input", nargs="+", help=".txt (paragraphs), .jsonl, .json.gz, .gz files (default: C4)")
    arg("--shards", type=int, help=f"C4 shards to download (default {SHARDS}; see the table)")
    arg("--out", default="data", help="output folder (%(default)s)")
    arg("--vocab-size", type=int, help=f"tokens incl. 4 specials ({VOCAB_SIZE}, or --tokenizer's)")
    arg("--seq-len", type=int, default=SEQ_LEN, help="tokens per packed row (%(default)s)")
    arg("--trash", type=float, default=TRASH, help="tokens/char that drop a document (%(default)s)")
    arg("--sample-mb", type=float, default=SAMPLE_MB, help="tokenizer sample (%(default)s MB)")
    arg("--tokenizer", help="reuse the tokenizer of an earlier output folder instead of training")
    arg("--workers", type=int, default=os.cpu_count() or 1, help="processes (%(default)s)")
    args = ap.parse_args(argv)
    if args.input and args.shards:
        die("--shards chooses C4 shards: not with --input")
    return args


def build(args, files, given, pool, fetcher, stop):
    """The tokenizer (trained, or `given` (meta, tok)), then the packed rows; -> the new meta."""
    count = args.shards or SHARDS
    shards = functools.partial(c4_shards, args.out, count, fetcher, stop)  # a pass each
    if given:
        tok, per_char = given[1], given[0].get("sample_tokens_per_char", TRASH_REF)
    else:
        tok, per_char = make_tokenizer(pool, files or shards(), args)
    sha = hashlib.sha256(tok["ranks"].encode()).hexdigest()
    with open(os.path.join(args.out, "tokenizer.tmp"), "w") as f:
        f.write(tok["ranks"])
        tok_file = seal(f, f"tokenizer-{sha[:8]}.tiktoken")
    spec = dict(tok, ranks=None, file=os.path.join(args.out, tok_file))  # workers read the file
    limit = args.trash * per_char / TRASH_REF
    train, val, s = encode(pool, files or shards(), spec, limit, args)
    if not s["documents"] and s["trash_dropped"]:
        die(f"the trash filter dropped all {s['trash_dropped']:,} documents (more than "
            f"{limit:.3f} tokens per character); raise --trash (now {args.trash:g})")
    if not train["rows"] or not val["rows"]:
        die(f"too little data for a train and a val row of {args.seq_len} tokens; give more text")
    filters = ("bad_lines", "duplicates_dropped", "trash_dropped", "trash_chars_dropped")
    return {"format": "cram-data-2", "vocab_size": len(tok["ranks"].splitlines()) + len(SPECIALS),
            "seq_len": args.seq_len, "special_tokens": tok["special_tokens"], "trash": args.trash,
            "pattern": tok["pattern"], "tokenizer_file": tok_file, "train": train, "val": val,
            "sample_tokens_per_char": round(per_char, 6), "filters": {k: s[k] for k in filters},
            "documents": s["documents"], "characters": s["characters"], "tokens": s["tokens"],
            "sources": files or [C4_URL.format(i=i) for i in range(count)]}


@entry
def main(argv=None):
    args = parse_args(argv)
    for path in args.input or []:
        if not os.path.isfile(path):
            die(f"input not found: {path}")
    given = read_prepared(args.tokenizer)[:2] if args.tokenizer else None
    if given and args.vocab_size not in (None, given[0]["vocab_size"]):
        die(f"--vocab-size {args.vocab_size}: {args.tokenizer} has {given[0]['vocab_size']} tokens")
    args.vocab_size = args.vocab_size or VOCAB_SIZE
    with claim(args.out, "prepare.py"):
        # The pool before any thread (forking a threaded process is unsafe); workers ignore Ctrl-C
        pool = multiprocessing.Pool(args.workers, signal.signal, (signal.SIGINT, signal.SIG_IGN))
        fetcher, stop = ThreadPoolExecutor(1), threading.Event()  # downloads the next C4 shard
        try:
            meta = build(args, args.input, given, pool, fetcher, stop)
            with open(os.path.join(args.out, "meta.json.tmp"), "w") as f:
                f.write(json.dumps(meta, indent=1))
                seal(f, "meta.json")  # the commit: from here on the folder holds the new data
        finally:
            stop.set()  # a download in flight gives up at its next block
            fetcher.shutdown(cancel_futures=True)
            pool.terminate()
            sweep(args.out)
    dropped, chars = meta["filters"]["trash_chars_dropped"], meta["characters"]
    print(f"{args.out}: {meta['tokens']:,} tokens, {json.dumps(meta['filters'])}")
    if dropped > TRASH_WARN * (chars + dropped):
        print(f"WARNING: the trash filter dropped {dropped:,} of {chars + dropped:,} characters; "
              f"if that is normal text, raise --trash (now {args.trash:g})", file=sys.stderr)
    return meta


if __name__ == "__main__":
    main()
