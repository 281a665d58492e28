"""
prepare.py: raw English text -> a BPE tokenizer trained on it -> packed, memmapped rows.

The Cramming recipe (Geiping & Goldstein 2023): normalise (NFD, strip accents, lowercase),
drop duplicates and "trash" documents that tokenize badly, train the tokenizer on the
corpus itself, join documents with [SEP] and cut the stream into 128-token rows.

    python prepare.py                              # download C4 shards, write data/
    python prepare.py --input corpus.jsonl.gz      # or use local files, fully offline
    python prepare.py --input more.txt --tokenizer data/ --out heldout/   # reuse a vocabulary
"""
import argparse, base64, gzip, hashlib, heapq, json, os, re, resource, sys, time, unicodedata, zlib
from collections import Counter, defaultdict

import numpy as np
import requests
import tiktoken

SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[MASK]"]
# GPT-2 style pre-tokenisation, written so Python's `re` (training) and tiktoken's Rust engine
# (encoding) split text the same way: letters, digits, other symbols, whitespace.
PATTERN = r"""'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
C4_URL = "https://huggingface.co/datasets/allenai/c4/resolve/main/en/c4-train.{i:05d}-of-01024.json.gz"
VAL_EVERY, VAL_CAP = 200, 1 << 20  # every 200th document is held out, up to ~1M tokens
RETRIES, BACKOFF = 5, 2.0


def die(msg):
    raise SystemExit(f"error: {msg}")


def rate(done, total, t0, unit):
    """'12.3 MB/s, ETA 0:42' for progress lines."""
    r = done / max(time.time() - t0, 1e-9)
    left = (total - done) / r if total and r > 0 else 0
    return f"{r:,.1f} {unit}/s, ETA {int(left) // 60}:{int(left) % 60:02d}"


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
        r = done / max(now - self.t0, 1e-9)
        line = f"{self.what}: {done:,.1f}"
        if self.total:
            left = int((self.total - done) / r) if r > 0 else 0
            line += f"/{self.total:,.1f} {self.unit}, {r:,.1f} {self.unit}/s, ETA {left // 60}:{left % 60:02d}"
        else:
            line += f" {self.unit}, {r:,.1f} {self.unit}/s"
        print(line + extra, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- download
def download(url, path):
    """Stream url to path.part, resume it with a Range request, rename when complete."""
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    part, err = path + ".part", None
    for attempt in range(RETRIES):
        if attempt:
            time.sleep(BACKOFF * 2 ** (attempt - 1))
        have = os.path.getsize(part) if os.path.exists(part) else 0
        try:
            with requests.get(url, stream=True, timeout=(10, 60),
                              headers={"Range": f"bytes={have}-"} if have else {}) as r:
                if r.status_code == 416:  # the .part already holds everything
                    os.replace(part, path)
                    return path
                if r.status_code not in (200, 206):
                    err = f"HTTP {r.status_code}"
                    if r.status_code < 500 and r.status_code != 429:
                        break  # 404 and friends will not get better by retrying
                    continue
                if r.status_code == 200:
                    have = 0  # server ignored the Range header: start over
                total = have + int(r.headers.get("Content-Length", 0))
                t0, done = time.time(), 0
                with open(part, "ab" if have else "wb") as f:
                    for block in r.iter_content(1 << 20):
                        f.write(block)
                        done += len(block)
                        print(f"\r{os.path.basename(path)}: {(have + done) / 1e6:,.1f}/{total / 1e6:,.1f} MB, "
                              f"{rate(done / 1e6, (total - have) / 1e6, t0, 'MB')}", end="", file=sys.stderr)
                print(file=sys.stderr)
                if total > have and os.path.getsize(part) != total:
                    raise IOError(f"truncated: {os.path.getsize(part)} of {total} bytes")
                os.replace(part, path)
                return path
        except (requests.RequestException, IOError) as e:
            err = f"{type(e).__name__}: {str(e)[:200]}"
    die(f"download failed: {url}: {err}")


# ----------------------------------------------------------------------------- reading
MARKS = None


def normalize(text):
    """NFD, drop combining marks (accents), lowercase, collapse whitespace: the paper's cleaning."""
    global MARKS
    if MARKS is None:
        MARKS = re.compile("[" + "".join(chr(c) for c in range(0x300, 0x110000)
                                         if unicodedata.category(chr(c)) == "Mn") + "]")
    if not text.isascii():
        text = MARKS.sub("", unicodedata.normalize("NFD", text))
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


def documents(files, stats, progress=""):
    """Yield raw documents from every file; a bad line is skipped and counted, a bad file is fatal."""
    total, done, t0 = sum(os.path.getsize(f) for f in files), 0, time.time()
    last = t0
    for path in files:
        raw = open(path, "rb")
        f = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
        jsonl, para = ".json" in os.path.basename(path), []
        try:
            for lineno, line in enumerate(f, 1):
                try:
                    line = line.decode("utf-8")
                    if jsonl:
                        if line.strip():
                            yield json.loads(line)["text"]
                    elif line.strip():
                        para.append(line.strip())
                    elif para:
                        yield " ".join(para)
                        para = []
                except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
                    stats["bad_lines"] += 1
                    if stats["bad_lines"] <= 5:
                        print(f"warning: {path}:{lineno}: skipped ({type(e).__name__}: {str(e)[:80]})", file=sys.stderr)
                if progress and time.time() - last > 2:
                    last, pos = time.time(), done + raw.tell()
                    print(f"{progress}: {pos / 1e6:,.1f}/{total / 1e6:,.1f} MB, {rate(pos / 1e6, total / 1e6, t0, 'MB')}",
                          file=sys.stderr)
            if para:
                yield " ".join(para)
        except (OSError, EOFError, zlib.error) as e:
            die(f"{path}: corrupt or truncated file ({e})")
        finally:
            done += raw.tell()
            raw.close()


def clean(files, stats, progress=""):
    """Normalised, non-empty, exactly-deduplicated documents."""
    seen = set()
    for text in documents(files, stats, progress):
        stats["documents_read"] += 1
        text = normalize(text)
        key = hashlib.blake2b(text.encode(), digest_size=8).digest()
        if not text or key in seen:
            stats["duplicates_dropped" if text else "empty_dropped"] += 1
            stats["duplicate_chars_dropped"] += len(text)
            continue
        seen.add(key)
        yield text


# ----------------------------------------------------------------------------- tokenizer
def train_bpe(counts, n_vocab):
    """Byte-level BPE on chunk counts. Pair counts are updated incrementally: each merge only
    touches the chunks that contain the merged pair, and a heap finds the next best pair."""
    words = [list(w.encode()) for w in counts]
    freq = list(counts.values())
    pairs, where = defaultdict(int), defaultdict(set)
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pairs[p] += freq[i]
            where[p].add(i)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    vocab = [bytes([b]) for b in range(256)]
    t0, last, n_merges = time.time(), time.time(), n_vocab - 256
    while len(vocab) < n_vocab and heap:
        c, p = heapq.heappop(heap)
        if -c != pairs.get(p):
            continue  # stale heap entry
        if -c < 2:
            break  # nothing left that repeats: a smaller vocabulary is all this text supports
        new, changed = len(vocab), set()
        vocab.append(vocab[p[0]] + vocab[p[1]])
        for i in where.pop(p):
            w, f, out, j = words[i], freq[i], [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == p[0] and w[j + 1] == p[1]:
                    out.append(new)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            if len(out) == len(w):
                continue
            for q in zip(w, w[1:]):
                pairs[q] -= f
                changed.add(q)
            for q in zip(out, out[1:]):
                pairs[q] += f
                where[q].add(i)
                changed.add(q)
            words[i] = out
        del pairs[p]
        changed.discard(p)
        for q in changed:
            if pairs[q] > 0:
                heapq.heappush(heap, (-pairs[q], q))
            else:
                del pairs[q]
        if time.time() - last > 2:
            last, k = time.time(), len(vocab) - 256
            print(f"tokenizer: {k:,}/{n_merges:,} merges, {rate(k, n_merges, t0, 'merges')}", file=sys.stderr)
    return {b: i for i, b in enumerate(vocab)}


def ranks_text(ranks):
    """tiktoken's rank-file format: base64(token) rank, one per line."""
    return "".join(f"{base64.b64encode(b).decode()} {r}\n" for b, r in sorted(ranks.items(), key=lambda x: x[1]))


def load_tokenizer(tok):
    """tiktoken.Encoding from the dict stored in meta.json / checkpoints (ranks as rank-file text)."""
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in tok["ranks"].splitlines())}
    return tiktoken.Encoding("cram", pat_str=tok["pattern"], mergeable_ranks=ranks,
                             special_tokens=tok["special_tokens"])


def read_prepared(folder):
    """(meta, tokenizer dict, {"train": rows, "val": rows}) of a folder written by prepare.py;
    rows are read-only memmaps of shape (N, seq_len). The one place that reads a prepared folder.
    File sizes are checked against meta.json (cheap), so a damaged .bin is named at start-up."""
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
        with open(os.path.join(folder, meta["tokenizer_file"])) as f:
            tok = {"ranks": f.read(), "pattern": meta["pattern"],
                   "special_tokens": meta["special_tokens"]}
        rows = {}
        for split in ("train", "val"):
            path = os.path.join(folder, f"{split}.bin")
            size = os.path.getsize(path) if os.path.exists(path) else None
            if size != meta[split]["bytes"]:
                die(f"{path}: {'missing' if size is None else f'{size:,} bytes'}, but meta.json says "
                    f"{meta[split]['bytes']:,}: damaged; run prepare.py again")
            rows[split] = np.memmap(path, dtype=np.uint16, mode="r").reshape(-1, meta["seq_len"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        die(f"{folder}: no prepared data ({type(e).__name__}: {e}); run prepare.py --out {folder}")
    return meta, tok, rows


# ----------------------------------------------------------------------------- packing
class Packer:
    """Appends documents + [SEP] to a flat uint16 file, keeping only whole rows."""

    def __init__(self, path, seq_len, sep):
        self.path, self.L, self.sep = path, seq_len, sep
        self.f, self.rest, self.rows, self.sha = open(path + ".tmp", "wb"), np.zeros(0, np.uint16), 0, hashlib.sha256()

    def add(self, docs):
        flat = np.concatenate([self.rest] + [np.array(d + [self.sep], np.uint16) for d in docs])
        n = len(flat) // self.L * self.L
        self.f.write(flat[:n].tobytes())
        self.sha.update(flat[:n].tobytes())
        self.rest, self.rows = flat[n:], self.rows + n // self.L

    def close(self):
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"rows": self.rows, "tokens": self.rows * self.L, "bytes": self.rows * self.L * 2,
                "sha256": self.sha.hexdigest()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", help="local .txt/.txt.gz (blank-line separated) or .jsonl/.jsonl.gz/.json.gz files or folders; default: download C4")
    ap.add_argument("--shards", type=int, default=32, help="C4 train shards to download; each is ~320 MB of gzip, ~0.8 GB of text, "
                    "~0.17 B tokens (an estimate from C4's published size); 32 ~ the paper's 5.5 B tokens")
    ap.add_argument("--out", default="data", help="output folder: train.bin, val.bin, tokenizer.tiktoken, meta.json")
    ap.add_argument("--vocab-size", type=int, default=32768, help="vocabulary size including the 4 special tokens")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per packed row")
    ap.add_argument("--trash", type=float, default=0.3, help="drop documents with more than trash x characters tokens")
    ap.add_argument("--sample-mb", type=float, default=100, help="MB of cleaned text the tokenizer is trained on")
    ap.add_argument("--tokenizer", help="reuse the tokenizer of an earlier output folder instead of training one")
    args = ap.parse_args(argv)
    if not 260 < args.vocab_size <= 65536:
        die(f"--vocab-size {args.vocab_size}: must be in 261..65536 (rows are stored as uint16)")
    if args.seq_len < 2:
        die(f"--seq-len {args.seq_len}: must be at least 2")
    times, t_start = {}, time.time()

    reused = read_prepared(args.tokenizer)[1] if args.tokenizer else None  # read before --out may be cleared
    if args.input:
        files = input_files(args.input)
    else:
        raw = os.path.join(args.out, "raw")
        files = [download(C4_URL.format(i=i), os.path.join(raw, f"c4-train.{i:05d}.json.gz")) for i in range(args.shards)]
        times["download"] = time.time() - t_start
    os.makedirs(args.out, exist_ok=True)
    meta_path = os.path.join(args.out, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)  # a failed run must not leave an old meta.json vouching for new files

    stats = Counter(bad_lines=0)
    if reused:
        tok = reused
    else:
        t0, counts, size = time.time(), Counter(), 0
        for text in clean(files, Counter(bad_lines=0), progress="tokenizer sample"):
            counts.update(re.findall(PATTERN, text))
            size += len(text)
            if size >= args.sample_mb * 1e6:
                break
        if not counts:
            die(f"no text in {' '.join(files)}")
        times["tokenizer_count"], t0 = time.time() - t0, time.time()
        ranks = train_bpe(counts, args.vocab_size - len(SPECIALS))
        times["tokenizer_train"] = time.time() - t0
        tok = {"ranks": ranks_text(ranks), "pattern": PATTERN,
               "special_tokens": {s: len(ranks) + i for i, s in enumerate(SPECIALS)}}
        print(f"tokenizer: {len(ranks) + len(SPECIALS):,} tokens from {size / 1e6:,.1f} MB in "
              f"{times['tokenizer_count'] + times['tokenizer_train']:.0f}s", file=sys.stderr)
    enc = load_tokenizer(tok)
    sep = tok["special_tokens"]["[SEP]"]

    # Tokenise in batches on all cores, stream rows to disk: memory stays flat.
    t0 = time.time()
    train = Packer(os.path.join(args.out, "train.bin"), args.seq_len, sep)
    val = Packer(os.path.join(args.out, "val.bin"), args.seq_len, sep)
    tok_path = os.path.join(args.out, "tokenizer.tiktoken")
    try:
        batch, n_doc, chars, tokens, val_tokens = [], 0, 0, 0, 0

        def flush():
            nonlocal n_doc, chars, tokens, val_tokens
            for text, ids in zip(batch, enc.encode_ordinary_batch(batch, num_threads=os.cpu_count() or 1)):
                if len(ids) > args.trash * len(text):
                    stats["trash_dropped"] += 1
                    stats["trash_chars_dropped"] += len(text)
                    continue
                # every 200th document is held out, and the first ones until val has a row
                if val_tokens < VAL_CAP and (n_doc % VAL_EVERY == 0 or val_tokens < args.seq_len):
                    val.add([ids])
                    val_tokens += len(ids) + 1
                else:
                    train.add([ids])
                n_doc, chars, tokens = n_doc + 1, chars + len(text), tokens + len(ids)
            batch.clear()

        for text in clean(files, stats, progress="tokenize"):
            batch.append(text)
            if len(batch) == 1024:
                flush()
        flush()
        train_info, val_info = train.close(), val.close()
        if not train_info["rows"] or not val_info["rows"]:
            die(f"too little data: {tokens:,} tokens make {train_info['rows']} train and {val_info['rows']} val rows "
                f"of {args.seq_len}; give more text")
        times["tokenize_pack"] = time.time() - t0
        with open(tok_path + ".tmp", "w") as f:
            f.write(tok["ranks"])
        meta = {
            "format": "cram-data-1", "vocab_size": len(enc._mergeable_ranks) + len(SPECIALS), "seq_len": args.seq_len,
            "dtype": "uint16", "special_tokens": tok["special_tokens"], "pattern": tok["pattern"],
            "normalization": "NFD, strip combining marks (accents), lowercase, collapse whitespace",
            "tokenizer_file": "tokenizer.tiktoken", "trash": args.trash,
            "documents": n_doc, "characters": chars, "tokens": tokens,
            "chars_per_token": round(chars / max(tokens, 1), 4),
            "filters": {k: stats[k] for k in ("documents_read", "bad_lines", "empty_dropped", "duplicates_dropped",
                                              "duplicate_chars_dropped", "trash_dropped", "trash_chars_dropped")},
            "train": train_info, "val": val_info, "sources": files,
        }
        for p in (tok_path, train.path, val.path):
            os.replace(p + ".tmp", p)
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(meta_path + ".tmp", meta_path)  # last: its presence says the folder is complete
    finally:
        for p in (tok_path, train.path, val.path, meta_path):
            if os.path.exists(p + ".tmp"):
                os.remove(p + ".tmp")

    f = meta["filters"]
    print(f"documents: {f['documents_read']:,} read, {f['bad_lines']} bad lines, {f['empty_dropped']} empty, "
          f"{f['duplicates_dropped']:,} duplicates ({f['duplicate_chars_dropped']:,} chars), "
          f"{f['trash_dropped']:,} trash ({f['trash_chars_dropped']:,} chars) dropped; {n_doc:,} kept")
    print(f"tokens: {tokens:,} ({meta['chars_per_token']:.2f} chars/token) -> {train_info['rows']:,} train rows, "
          f"{val_info['rows']:,} val rows of {args.seq_len} in {args.out}/")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()) +
          f", total {time.time() - t_start:.1f}s; peak memory {peak:,.0f} MB")
    return meta


if __name__ == "__main__":
    main()
