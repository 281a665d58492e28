"""prepare.py: raw English text -> a BPE tokenizer trained on it -> packed, memmapped rows.

    python prepare.py                              # download 33 C4 shards, write data/
    python prepare.py --input corpus.jsonl.gz      # or use local files, fully offline

The folder gets train.bin and val.bin (uint16 token ids, rows of --seq-len), tokenizer.tiktoken
and, written last, meta.json: a folder without meta.json is not data."""
import argparse, base64, contextlib, functools, gzip, hashlib, heapq, itertools, json
import mmap, multiprocessing, os, pathlib, re, signal, sys, time, unicodedata, zlib
from collections import Counter, defaultdict, deque, namedtuple

import numpy as np, requests, tiktoken

# ----------------------------------------------------------------------------- the recipe
VOCAB_SIZE = 32768  # the paper's vocabulary, special tokens included
SEQ_LEN = 128       # the paper's row length: short rows are what make one day enough
TRASH = 0.3         # the paper: keep a document only if it has fewer tokens than 0.3 x characters
SAMPLE_MB = 100     # MB the tokenizer learns from; less tokenises worse (the README's Measurements)
SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[MASK]"]  # they take the last ids of the vocabulary
# GPT-2 style pre-tokenisation that Python's `re` (training) and tiktoken (encoding) split alike
PATTERN = r"""'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
VAL_EVERY = 200     # every 200th document until VAL_CAP: a sample of the first ~4% of 5.5 B tokens
VAL_CAP = 1 << 20   # up to ~1 M tokens (0.02% of 5.5 B): 4x what cram.py validates on, by default
SHARDS = 33         # C4 shards (~0.17 B tokens each) for the paper's 5.5 B tokens; see the README
C4_SHARDS = 1024    # C4's English training shards, all of them ("-of-01024" in C4_URL)
C4_URL = ("https://huggingface.co/datasets/allenai/c4/resolve/main/en/"
          "c4-train.{i:05d}-of-01024.json.gz")
JOB_BYTES = 1 << 20  # text per worker job: big enough to hide the hand-over, small enough for RAM
RETRIES = 5         # download attempts; the waits between them double: ~30 s of trouble ridden out
BACKOFF = 2.0       # the first wait (s)
TIMEOUT = (10, 60)  # s a download may wait to connect, then for its next bytes, before a retry
PROGRESS_EVERY = 2.0  # s at least between two progress lines of a long step


# ----------------------------------------------------------------------------- reading
# A document's way: file -> jobs (main process) -> a worker (texts, normalize; count_chunks or
# encode_job) -> in_order, back to the main process (train_tokenizer, or pack: held_out?) -> rows

def read_records(f, is_json):
    """A file's records, as bytes: each line of a .json* file, each paragraph of a .txt file."""
    lines = (line.strip() for line in f)
    if is_json:
        return (line for line in lines if line)
    return (b" ".join(run) for nonblank, run in itertools.groupby(lines, key=bool) if nonblank)


def jobs(args):
    """Jobs of (is_json, records), ~JOB_BYTES of one file each: the same for any worker count."""
    fix = "" if args.input else "; delete it and run again: it is downloaded again"  # C4's
    for path in args.files:
        is_json = ".json" in os.path.basename(path)
        job, size = [], 0
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            try:
                for record in read_records(f, is_json):
                    job.append(record)
                    size += len(record)
                    if size >= JOB_BYTES:
                        yield is_json, job
                        job, size = [], 0
            except (OSError, EOFError, zlib.error) as e:
                damaged(path, e, fix)
        if job:
            yield is_json, job


def in_order(pool, fn, extra, args):
    """fn(job, *extra) for each job of args.files, on the pool, results in order. At most two jobs
    per worker are in flight, so memory stays flat (Pool.imap would read every file ahead)."""
    handed_out = (pool.apply_async(fn, (job, *extra)) for job in jobs(args))
    pending = deque(itertools.islice(handed_out, 2 * args.workers))
    while pending:
        result = pending.popleft().get()
        pending.extend(itertools.islice(handed_out, 1))
        yield result


# ----------------------------------------------------------------------------- in the workers
def normalize(text):
    """v2's cleaning: NFD splits off accents, then all non-ASCII goes (accents, curly quotes,
    dashes, emoji), lowercase, whitespace collapsed: 'Café — NAÏVE\\n' -> 'cafe naive'."""
    text = unicodedata.normalize("NFD", text).encode("ascii", "ignore").decode()
    return " ".join(text.lower().split())


def texts(is_json, records):
    """Each record's normalised text, or None for a bad record (broken JSON or UTF-8, no text)."""
    for record in records:
        try:
            text = json.loads(record).get("text") if is_json else record.decode("utf-8")
        except (ValueError, AttributeError):  # AttributeError: JSON that is not an object
            text = None
        yield (normalize(text) or None) if isinstance(text, str) else None


def count_chunks(job):
    """For the tokenizer: (count of each pre-tokenised chunk, characters) of a job."""
    counts, chars = Counter(), 0
    for text in filter(None, texts(*job)):
        counts.update(re.findall(PATTERN, text))
        chars += len(text)
    return counts, chars


Doc = namedtuple("Doc", "key chars ids")  # a document: a hash of its text, its length, its tokens


@functools.cache  # the rank file is read once per worker, at its first job
def worker_tokenizer(rank_file, pattern):
    return load_tokenizer({"ranks": pathlib.Path(rank_file).read_text(), "pattern": pattern})


def encode_job(job, rank_file, pattern):
    enc = worker_tokenizer(rank_file, pattern)
    docs = [None] * len(job[1])  # None stays for a bad record
    for i, text in enumerate(texts(*job)):
        if text is not None:
            key = hashlib.blake2b(text.encode(), digest_size=8).digest()  # pack's duplicate check
            docs[i] = Doc(key, len(text), np.array(enc.encode_ordinary(text), np.uint16))
    return docs


# ----------------------------------------------------------------------------- the tokenizer
def train_bpe(counts, n_vocab):
    """Byte-level BPE: merge the most frequent adjacent pair (ties: the smaller) into a new token,
    over and over. A word (a pre-tokenised chunk) is a str of chr(id)s, so a merge is a str.replace:
    {' cat': 3, ' hat': 2} has pairs ' c' 3, 'ca' 3, 'at' 5, ' h' 2, 'ha' 2; 'at' becomes
    chr(256): [' c\u0100', ' h\u0100'], vocab[256] = b'at', new pairs 'c\u0100' 3, 'h\u0100' 2.
    test_cram.py's naive_bpe is the specification; here a merge visits only its pair's words."""
    words = ["".join(map(chr, word.encode())) for word in counts]
    freqs = list(counts.values())  # freqs[i]: how often words[i] is in the text
    pair_counts = defaultdict(int)  # a pair's count in the words, times their freqs
    words_with = defaultdict(set)  # a pair -> the words that hold it, or held it
    for i, word in enumerate(words):
        for j in range(len(word) - 1):  # word[j:j + 2]: the pair at j, sliced inline (no call)
            pair_counts[word[j:j + 2]] += freqs[i]
            words_with[word[j:j + 2]].add(i)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)  # the most frequent pair first; 2-char strs order as pairs of ids do
    vocab = [bytes([b]) for b in range(256)]  # vocab[id]: the token's bytes
    progress = Progress("tokenizer", n_vocab - 256, "merges")
    while len(vocab) < n_vocab and heap:
        minus_count, pair = heapq.heappop(heap)
        if -minus_count != pair_counts[pair]:
            continue  # stale: a merge changed the count since this push, and pushed it again
        if -minus_count < 2:
            break  # nothing left that repeats: a smaller vocabulary is all this text supports
        token = chr(len(vocab))  # the merged pair's id, as a char
        vocab.append(vocab[ord(pair[0])] + vocab[ord(pair[1])])
        changes = defaultdict(int)  # a pair -> what this merge adds to its count, in all its words
        for i in words_with.pop(pair):
            word, freq = words[i], freqs[i]
            if pair not in word:
                continue  # no word leaves a set of words_with: an earlier merge took this pair
            for j in range(len(word) - 1):  # every pair of the word goes,
                changes[word[j:j + 2]] -= freq
            words[i] = word = word.replace(pair, token)
            for j in range(len(word) - 1):  # every pair of the merged word comes
                new = word[j:j + 2]
                changes[new] += freq
                if token in new:  # the word's other pairs are listed already
                    words_with[new].add(i)
        for changed, change in changes.items():  # once per pair, its changes summed over the words
            if change:  # ' c' above, kept by the merge, nets -3 + 3: left as it is
                pair_counts[changed] += change
                heapq.heappush(heap, (-pair_counts[changed], changed))  # again, with its new count
        progress(len(vocab) - 256)
    assert len(set(vocab)) == len(vocab), "two merges made the same bytes: their ids would clash"
    return {token_bytes: i for i, token_bytes in enumerate(vocab)}


def load_tokenizer(tok):
    """tiktoken.Encoding of a checkpoint's "tokenizer" dict, or read_prepared's; "ranks": a rank
    file's text, a line a token: its bytes in base64, its id ('IGNhdA== 1000': b' cat' is 1000)."""
    lines = map(str.split, tok["ranks"].splitlines())
    vocab = {base64.b64decode(b64): int(rank) for b64, rank in lines}
    return tiktoken.Encoding("cram", pat_str=tok["pattern"], mergeable_ranks=vocab,
                             special_tokens=tok.get("special_tokens", {}))


def train_tokenizer(pool, args):
    """A BPE of --vocab-size tokens from the first --sample-mb of text, in whole jobs."""
    counts, chars = Counter(), 0
    progress = Progress("tokenizer sample", args.sample_mb, "MB")
    for job_counts, job_chars in in_order(pool, count_chunks, (), args):
        counts.update(job_counts)
        chars += job_chars
        progress(chars / 1e6)
        if chars >= args.sample_mb * 1e6:
            break
    vocab = train_bpe(counts, args.vocab_size - len(SPECIALS))
    lines = [f"{base64.b64encode(token).decode()} {i}\n" for token, i in vocab.items()]
    specials = {s: len(vocab) + i for i, s in enumerate(SPECIALS)}
    return {"ranks": "".join(lines), "pattern": PATTERN, "special_tokens": specials}


# ----------------------------------------------------------------------------- packing
def close_rows(f, seq_len):
    """Cut token ids to whole rows of seq_len, on the disk before meta.json names them; -> rows."""
    rows = f.tell() // (2 * seq_len)
    f.truncate(rows * seq_len * 2)  # flushes first
    os.fsync(f.fileno())
    f.close()
    return rows


def held_out(kept, val_tokens, seq_len):
    """Whether the next kept document goes to val.bin: every VAL_EVERY-th (a sample, not one run of
    text), and any while val holds less than a row (small inputs get one); none from VAL_CAP on."""
    return val_tokens < VAL_CAP and (kept % VAL_EVERY == 0 or val_tokens < seq_len)


def pack(pool, rank_file, tok, args):
    """Documents in order, exact duplicates and trash dropped, joined by [SEP] into rows: those
    `held_out` picks into val.bin, the rest into train.bin; -> train rows, val rows, the report."""
    stats, seen = Counter(), set()  # the report: what was kept and dropped; the kept ones' keys
    sep = np.uint16(tok["special_tokens"]["[SEP]"]).tobytes()
    train, val = (open(os.path.join(args.out, f"{split}.bin"), "wb") for split in ("train", "val"))
    progress = Progress("encode", 0, "MB of text")
    for docs in in_order(pool, encode_job, (rank_file, tok["pattern"]), args):
        for doc in docs:
            if doc is None:
                stats["bad_lines"] += 1
            elif doc.key in seen:
                stats["duplicates"] += 1
            elif args.trash and len(doc.ids) >= args.trash * doc.chars:  # the trash filter
                stats.update(trash=1, trash_chars=doc.chars)
            else:  # len(seen): the documents kept so far; val.tell() // 2: the tokens in val.bin
                split = val if held_out(len(seen), val.tell() // 2, args.seq_len) else train
                split.write(doc.ids.tobytes() + sep)
                seen.add(doc.key)
                stats.update(documents=1, characters=doc.chars, tokens=len(doc.ids))
        progress(stats["characters"] / 1e6)
    return close_rows(train, args.seq_len), close_rows(val, args.seq_len), stats


def write_data(args, pool):
    tok = train_tokenizer(pool, args)
    rank_file = os.path.join(args.out, "tokenizer.tiktoken")
    pathlib.Path(rank_file).write_text(tok["ranks"])
    train_rows, val_rows, stats = pack(pool, rank_file, tok, args)
    if not train_rows or not val_rows:
        die(f"too little data for a train and a val row of {args.seq_len} tokens; give more text, "
            f"or raise --trash {args.trash:g} if its {stats['trash']:,} dropped documents are text")
    sources = args.input or [C4_URL.format(i=i) for i in range(args.shards)]
    meta = {"vocab_size": len(tok["ranks"].splitlines()) + len(SPECIALS), "seq_len": args.seq_len,
            "special_tokens": tok["special_tokens"], "pattern": tok["pattern"],
            "train": {"rows": train_rows}, "val": {"rows": val_rows}, "trash": args.trash,
            "filters": {k: stats[k] for k in ("bad_lines", "duplicates", "trash", "trash_chars")},
            "documents": stats["documents"], "characters": stats["characters"],
            "tokens": stats["tokens"], "sources": sources}
    with atomic(os.path.join(args.out, "meta.json"), "w") as f:  # the commit: now it is data
        json.dump(meta, f, indent=1)
    return meta


# ----------------------------------------------------------------------------- shared plumbing
def die(msg):
    raise SystemExit(f"error: {msg}")


def damaged(path, error, fix=""):
    """A damaged input file, of any kind, is one line: the file, the error's first line, the fix."""
    first = str(error).strip().split("\n")[0][:120]
    die(f"{path}: damaged or unreadable ({type(error).__name__}: {first}){fix}")


def above_zero(kind, or_zero=False, most=float("inf")):
    """An argparse type: a finite number above 0 (or_zero: or 0) up to `most`, or argparse's error
    ('argument --lr: nan is not a finite number above 0'), not a run gone wrong (--time -1)."""
    def parse(text):
        number = kind(text)
        if not (0 <= number if or_zero else 0 < number) or number == float("inf") or number > most:
            zero = "0 or " if or_zero else ""
            cap = f", at most {most}" if most < float("inf") else ""
            raise argparse.ArgumentTypeError(f"{number} is not {zero}a finite number above 0{cap}")
        return number
    parse.__name__ = kind.__name__  # argparse names it in its message for 'abc': 'invalid float'
    return parse


def entry(main):
    """Each script's one handler: Ctrl-C exits with 130; an OS error on a named file (a missing
    --data, a full disk) is one line naming it; any other error keeps its traceback."""
    @functools.wraps(main)
    def guarded(argv=None):
        try:
            return main(argv)
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr, flush=True)
            raise SystemExit(130)
        except OSError as e:
            if not e.filename:  # not a file the script opened: a bug, or the machine's
                raise
            die(f"{e.filename}: {e.strerror or e}")
    return guarded


class Progress:
    """A long step's progress on stderr, every PROGRESS_EVERY s, `extra()` added. A later line, 20 s
    in: Progress("encode", 105.0, "MB")(52.5) -> 'encode: 52.5/105.0 MB, ETA 0:20, 2.6 MB/s'."""

    def __init__(self, what, total=0, unit=""):
        self.what, self.total, self.unit = what, total, unit  # total 0: a count, no ETA
        self.start = self.last = time.time()  # `last`: when the last line was printed

    def __call__(self, done, extra=lambda: "", force=False):
        now = time.time()
        if force or now - self.last >= PROGRESS_EVERY:
            rate = done / max(now - self.start, 1e-9)
            number = "{:,.1f}" if isinstance(done, float) else "{:,}"  # MB to 0.1, counts whole
            total = f"/{number.format(self.total)}" if self.total else ""
            line = f"{self.what}: {number.format(done)}{total} {self.unit}"
            if self.total and self.last > self.start:  # after a first line, the warm-up's rate
                left = int((self.total - done) / max(rate, 1e-9))
                line += f", ETA {left // 60}:{left % 60:02d}"
            print(f"{line}, {rate:,.1f} {self.unit}/s{extra()}", file=sys.stderr, flush=True)
            self.last = now


@contextlib.contextmanager
def atomic(path, mode="wb"):
    """Write path.tmp, sync it, rename it to path, sync the folder: a reader, even after a power
    cut, finds the old file or all of the new one, never half; a failed write removes path.tmp."""
    try:
        with open(path + ".tmp", mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        if isinstance(e, OSError) and not e.filename:  # a full disk's write or fsync names none
            e.filename = path
        raise
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    os.fsync(folder)
    os.close(folder)


def read_prepared(folder):
    """The one reader of a prepared folder: (meta, tokenizer, {split: memmapped rows})."""
    path = os.path.join(folder, "meta.json")
    try:
        meta = json.loads(pathlib.Path(path).read_text())
        path = os.path.join(folder, "tokenizer.tiktoken")
        tok = {"ranks": pathlib.Path(path).read_text(), "pattern": meta["pattern"],
               "special_tokens": meta["special_tokens"]}
        load_tokenizer(tok)  # it must parse, and hold every token (a file cut at a line parses)
        n_vocab = len(tok["ranks"].splitlines()) + len(tok["special_tokens"])
        if n_vocab != meta["vocab_size"]:
            raise ValueError(f"{n_vocab} tokens, specials too; meta.json says {meta['vocab_size']}")
        rows = {}
        for split in ("train", "val"):
            path = os.path.join(folder, f"{split}.bin")
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            mapped.madvise(mmap.MADV_RANDOM)  # random rows: no read-ahead, faster cold (README)
            rows[split] = np.frombuffer(mapped, np.uint16).reshape(-1, meta["seq_len"])
            if len(rows[split]) != meta[split]["rows"]:
                raise ValueError(f"{len(rows[split])} rows, meta.json says {meta[split]['rows']}")
    except PermissionError:
        raise  # the file is there, but this user cannot read it: entry says so, nothing is damaged
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, FileNotFoundError) and path.endswith("meta.json"):
            die(f"{folder}: no prepared data (no meta.json); run prepare.py --out {folder}")
        if isinstance(e, (KeyError, TypeError)):  # a key of meta.json missing, or not of its kind
            path = os.path.join(folder, "meta.json")
        damaged(path, e, f"; prepare the data again into another --out, or remove {folder} first")
    return meta, tok, rows


def download(url, path):
    """url -> path.part -> path, retried (each retry said); a path already there is not fetched."""
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for attempt in range(1, RETRIES + 1):
        try:
            with requests.get(url, stream=True, timeout=TIMEOUT) as response:
                if response.status_code != 200:  # a 404 too: retried, then said in one line
                    raise requests.HTTPError(f"HTTP {response.status_code}")
                with open(path + ".part", "wb") as f:  # each try starts it from zero
                    f.writelines(response.iter_content(1 << 16))  # a cut transfer raises
            os.replace(path + ".part", path)
            return path
        except (requests.RequestException, OSError) as e:
            cause = "connection failed" if isinstance(e, requests.ConnectionError) else str(e)[:200]
        wait = BACKOFF * 2 ** (attempt - 1)
        if attempt < RETRIES:
            print(f"download {url}: {cause} (attempt {attempt} of {RETRIES}); waiting {wait:g}s",
                  file=sys.stderr, flush=True)
            time.sleep(wait)
    die(f"download failed: {url}: {cause}")


# ----------------------------------------------------------------------------- the command line
def get_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    arg = ap.add_argument
    count = above_zero(int)  # 0 or less: argparse's error, not a run that fails later
    arg("--input", nargs="+", help="your text, not C4's: .txt (paragraphs), .jsonl, .gz of them")
    arg("--shards", type=above_zero(int, most=C4_SHARDS), default=SHARDS,
        help="how many C4 shards to download and use, from the first (%(default)s)")
    arg("--out", default="data", help="folder to write: new, or without meta.json (%(default)s)")
    arg("--vocab-size", type=int, default=VOCAB_SIZE, help="tokens incl. 4 specials (%(default)s)")
    arg("--seq-len", type=count, default=SEQ_LEN, help="tokens per packed row (%(default)s)")
    arg("--trash", type=above_zero(float, or_zero=True), default=TRASH,
        help="drop documents of at least this many tokens per character (%(default)s; 0: keep all)")
    arg("--sample-mb", type=above_zero(float), default=SAMPLE_MB,
        help="MB of text the tokenizer learns from, the first (%(default)s)")
    arg("--workers", type=count, default=os.cpu_count() or 1, help="worker processes (%(default)s)")
    args = ap.parse_args(argv)
    if not 256 + len(SPECIALS) <= args.vocab_size <= 1 << 16:
        ap.error(f"argument --vocab-size: {args.vocab_size} is not from 260 (the 256 bytes and "
                 f"the {len(SPECIALS)} specials) to 65536 (ids are stored as uint16)")
    return args


@entry
def main(argv=None):
    args = get_args(argv)
    if os.path.exists(os.path.join(args.out, "meta.json")):
        die(f"--out {args.out} holds prepared data (meta.json): choose another --out")
    os.makedirs(args.out, exist_ok=True)
    args.files = args.input or []  # or C4's first --shards, downloaded before the work starts
    progress = Progress("download", args.shards, "C4 shards")
    for i in range(0 if args.input else args.shards):  # a shard already there is not fetched again
        args.files.append(download(C4_URL.format(i=i), f"{args.out}/raw/c4-train.{i:05d}.json.gz"))
        progress(i + 1)
    # Workers ignore Ctrl-C: the main process answers it, and leaving the pool terminates them
    with multiprocessing.Pool(args.workers, signal.signal, (signal.SIGINT, signal.SIG_IGN)) as pool:
        meta = write_data(args, pool)
    print(f"{args.out}: {meta['documents']:,} documents, {meta['tokens']:,} tokens; dropped: "
          f"{json.dumps(meta['filters'])}")
    return meta


if __name__ == "__main__":
    main()
