"""
glue.py: fine-tune a crammed checkpoint on GLUE with the paper's "sane" recipe, print its table.
Missing GLUE files are downloaded; all are checked before any fine-tuning. Results merge into
glue.json next to the checkpoint: a rerun replaces only its tasks, and runs at once keep theirs.

    python glue.py --ckpt out/ckpt.pt                       # the eight tasks of the paper
    python glue.py --ckpt out/ckpt.pt --tasks RTE,MRPC --trials 5
    python glue.py --ckpt out/ckpt.pt --random-init         # the "no pretraining" row
"""
import fcntl, json, math, os, time, zipfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from prepare import Parser, Progress, die, download, entry, load_tokenizer, normalize
from cram import Crammed, load_checkpoint, load_model, pick_device

# ----------------------------------------------------------------------------- the "sane" recipe
LR = 4e-5            # peak AdamW learning rate
BATCH_SIZE = 16      # examples per optimizer step
EPOCHS = 5           # the challenge allows at most 5, one recipe for every task
WARMUP = 0.1         # linear warm-up over this fraction of the steps, then cosine decay to zero
BETAS = (0.9, 0.98)  # AdamW betas, as in pretraining
EPS = 1e-6           # AdamW epsilon
WEIGHT_DECAY = 0.0   # none: five short epochs from a pretrained start
DROPOUT = 0.1        # in the encoder and the head while fine-tuning (pretraining has none)
MAX_LEN = 128        # tokens per example with [CLS] and [SEP]s: the pretraining length
HEAD_DIM = 1024      # v2's head_dim: first token -> dense to this width, tanh, dropout, linear
TRIALS = 1           # fine-tuning runs per task; the paper reports the median of 5
LIMITS = {"epochs": (1, math.inf), "batch_size": (1, math.inf), "trials": (1, math.inf),
          "seed": (0, 2 ** 32 - 1),  # a seed that every random generator accepts
          "max_len": (4, math.inf),  # [CLS] a [SEP] b [SEP]; the top is the checkpoint's seq_len
          "lr": (1e-9, 1)}  # above 0: a smaller step does not move an fp32 weight of ~0.02

GLUE_URL = "https://dl.fbaipublicfiles.com/glue/data/{}.zip"
MRPC_URL = "https://dl.fbaipublicfiles.com/senteval/senteval_data/msr_paraphrase_train.txt"
MRPC_DEV_IDS_URL = ("https://firebasestorage.googleapis.com/v0/b/mtl-sentence-representations"
                    ".appspot.com/o/data%2Fmrpc_dev_ids.tsv?alt=media&token="
                    "ec5c0836-31d5-48f4-b431-7480817f1adc")
# task: (zip name, first text column, second text column, label column, labels; None = regression)
TASKS = {"CoLA": ("CoLA", "sentence", None, "label", ["0", "1"]),
         "SST-2": ("SST-2", "sentence", None, "label", ["0", "1"]),
         "MRPC": (None, "#1 String", "#2 String", "Quality", ["0", "1"]),
         "STS-B": ("STS-B", "sentence1", "sentence2", "score", None),
         "QQP": ("QQP-clean", "question1", "question2", "is_duplicate", ["0", "1"]),
         "MNLI": ("MNLI", "sentence1", "sentence2", "gold_label",
                  ["entailment", "neutral", "contradiction"]),
         "QNLI": ("QNLIv2", "question", "sentence", "label", ["entailment", "not_entailment"]),
         "RTE": ("RTE", "sentence1", "sentence2", "label", ["entailment", "not_entailment"]),
         "WNLI": ("WNLI", "sentence1", "sentence2", "label", ["0", "1"])}
COLA_HEADER = ["source", "label", "original_label", "sentence"]  # CoLA's files have no header
DEV = {t: {t: "dev.tsv"} for t in TASKS}  # {task: {dev split: file}}; MNLI has two
DEV["MNLI"] = {"MNLI-m": "dev_matched.tsv", "MNLI-mm": "dev_mismatched.tsv"}
METRICS = {"CoLA": ["mcc"], "STS-B": ["pearson", "spearman"], "MRPC": ["f1", "accuracy"],
           "QQP": ["f1", "accuracy"]}  # the others: accuracy
# The paper's table in its column order; the GLUE score is the mean of these nine numbers.
COLUMNS = [("MNLI-m", "accuracy"), ("MNLI-mm", "accuracy"), ("SST-2", "accuracy"),
           ("STS-B", "pearson"), ("RTE", "accuracy"), ("QNLI", "accuracy"), ("QQP", "f1"),
           ("MRPC", "f1"), ("CoLA", "mcc")]
REFERENCE = {"BERT-base, fully trained": [83.2, 83.4, 91.9, 86.7, 59.2, 90.6, 87.7, 89.3, 56.5],
             "BERT-base, no pretraining": [34.1, 34.1, 79.9, 17.8, 47.3, 50.0, 68.6, 77.9, 0.0],
             "crammed BERT v1 (A6000, 24h)": [83.9, 84.1, 92.2, 84.6, 53.8, 89.5, 87.3, 87.5, 44.5],
             "crammed BERT v2 (best of 5)": [84.1, 84.6, 92.0, 87.4, 58.5, 90.2, 87.5, 88.9, 53.3]}


# ----------------------------------------------------------------------------- data files
def write_atomic(path, data):
    """Write beside path, then rename: a half-written file never looks complete."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def build_mrpc(folder):
    """GLUE builds MRPC itself: SentEval's train file, split into train/dev by dev id pairs.
    In bytes, as GLUE's script splits them: read_tsv then checks the text, naming the line."""
    src = download(MRPC_URL, os.path.join(folder, "msr_paraphrase_train.txt"))
    with open(download(MRPC_DEV_IDS_URL, os.path.join(folder, "mrpc_dev_ids.tsv")), "rb") as f:
        dev_ids = {tuple(line.split()) for line in f}
    with open(src, "rb") as f:  # the header keeps its BOM, as in GLUE's files
        header = f.readline().rstrip(b"\r\n")
        out = {"train.tsv": [header], "dev.tsv": [header]}
        for line in f:  # quality, #1 id, #2 id, #1 string, #2 string
            row = line.strip().split(b"\t")
            out["dev.tsv" if tuple(row[1:3]) in dev_ids else "train.tsv"].append(b"\t".join(row))
    for name, lines in out.items():
        write_atomic(os.path.join(folder, name), b"\n".join(lines) + b"\n")
    return folder


def ensure_task(task, glue_dir):
    folder = os.path.join(glue_dir, task)
    need = ["train.tsv", *DEV[task].values()]
    if all(os.path.exists(os.path.join(folder, f)) for f in need):
        return folder
    if task == "MRPC":
        return build_mrpc(folder)
    zpath = download(GLUE_URL.format(TASKS[task][0]), os.path.join(glue_dir, task + ".zip"))
    try:
        with zipfile.ZipFile(zpath) as z:
            # deepest first, so that RTE/train.tsv overwrites RTE/original/train.tsv
            members = sorted(z.namelist(), key=lambda m: m.count("/"), reverse=True)
            found = {os.path.basename(m): m for m in members}
            for name in need:
                write_atomic(os.path.join(folder, name), z.read(found[name]))
    except (zipfile.BadZipFile, KeyError) as e:
        die(f"{zpath}: not a GLUE zip file ({type(e).__name__}: {e}); delete it, run again")
    os.remove(zpath)
    return folder


def read_tsv(path, task):
    """[(text a, text b or None, label)] from a GLUE tsv file: tab separated, no quoting, lines
    split at \\n only (a stray \\r inside a text stays), MRPC's BOM dropped."""
    _, col_a, col_b, col_y, labels = TASKS[task]
    header, rows = (COLA_HEADER if task == "CoLA" else None), []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                fields = line.decode("utf-8-sig").rstrip("\r\n").split("\t")
            except UnicodeDecodeError as e:
                die(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start + 1})")
            if header is None:
                header = fields
            elif fields != [""]:  # not a blank line
                row = dict(zip(header, fields))
                try:  # a short row, or the file of another task, lacks a column
                    y = row[col_y]
                    rows.append((row[col_a], row[col_b] if col_b else None,
                                 float(y) if labels is None else labels.index(y)))
                except KeyError as e:
                    die(f"{path}:{n}: no {e.args[0]!r} column here (is this GLUE {task}?)")
                except ValueError:
                    wanted = "a number" if labels is None else "one of " + ", ".join(labels)
                    die(f"{path}:{n}: unknown label {y!r}, expected {wanted}")
    return rows


def truncate(a, b, room):
    """Cut the longer of two token lists first until both fit in room ("longest first").

    len(a)=100, len(b)=60, max_len=128 -> room 125 ([CLS] a [SEP] b [SEP] takes 3); 160 > 125:
    the shorter keeps min(60, 125 // 2) = 60 tokens and a keeps the other 65 -> (65, 60).
    len(a)=100, len(b)=90 -> b keeps min(90, 62) = 62 and a keeps 63: both are cut.
    A single sentence is a with b = [] and room max_len - 2: a keeps its first room tokens."""
    if len(a) + len(b) <= room:
        return a, b
    short = min(len(a), len(b), room // 2)
    if len(a) <= len(b):
        return a[:short], b[:room - short]
    return a[:room - short], b[:short]


def encode(enc, specials, rows, max_len):
    """`[CLS] a [SEP] b [SEP]` (or `[CLS] a [SEP]`) token lists, and the labels as a tensor."""
    cls, sep = specials["[CLS]"], specials["[SEP]"]
    a = enc.encode_ordinary_batch([normalize(r[0]) for r in rows])
    b = enc.encode_ordinary_batch([normalize(r[1] or "") for r in rows])
    ids = []
    for (_, text_b, _), x, y in zip(rows, a, b):
        pair = text_b is not None
        x, y = truncate(x, y, max_len - 3 if pair else max_len - 2)
        ids.append([cls] + x + [sep] + (y + [sep] if pair else []))
    return ids, torch.tensor([r[2] for r in rows])


def batches(ids, ys, order, batch_size, pad, device):
    """Each batch padded only to its longest row, with a mask saying which tokens are real."""
    for i in range(0, len(order), batch_size):
        rows = [torch.tensor(ids[j]) for j in order[i:i + batch_size]]
        x = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)
        mask = x != pad  # encode_ordinary never makes a special token: [PAD] is only padding
        yield x.to(device), mask.to(device), ys[order[i:i + batch_size]].to(device)


# ----------------------------------------------------------------------------- metrics (numpy)
def accuracy(p, y):
    return float(np.mean(np.asarray(p) == np.asarray(y)))


def f1(p, y):
    p, y = np.asarray(p) == 1, np.asarray(y) == 1
    tp = float(np.sum(p & y))  # 2tp / (2tp + fp + fn), and 2tp + fp + fn = |p| + |y|
    return 2 * tp / (np.sum(p) + np.sum(y)) if tp else 0.0


def pearson(p, y):
    p = np.asarray(p, np.float64) - np.mean(p)
    y = np.asarray(y, np.float64) - np.mean(y)
    d = math.sqrt(np.sum(p * p) * np.sum(y * y))
    return float(np.sum(p * y) / d) if d else 0.0  # a constant: no correlation, not nan


mcc = pearson  # for 0/1 labels Matthews' coefficient is exactly Pearson's r


def ranks(a):
    """1-based ranks, ties sharing their average rank: [10, 20, 20, 5] -> [2, 3.5, 3.5, 1]."""
    _, inv, counts = np.unique(a, return_inverse=True, return_counts=True)
    return (np.cumsum(counts) - (counts - 1) / 2)[inv]


def spearman(p, y):
    return pearson(ranks(p), ranks(y))


def score(task, p, y):
    """{metric name: value in percent}, the way the paper reports them."""
    fns = dict(accuracy=accuracy, f1=f1, mcc=mcc, pearson=pearson, spearman=spearman)
    return {m: 100 * fns[m](p, y) for m in METRICS.get(task, ["accuracy"])}


# ----------------------------------------------------------------------------- fine-tuning
class Classifier(nn.Module):
    """The crammed encoder, v2's pooler on the first token ([CLS], "zero_index"), a linear head."""

    def __init__(self, encoder, n_out):
        super().__init__()
        self.encoder = encoder
        width = encoder.config.width
        self.pooler = nn.Sequential(nn.Linear(width, HEAD_DIM), nn.Tanh(), nn.Dropout(DROPOUT))
        self.head = nn.Linear(HEAD_DIM, n_out)
        for m in self.pooler[0], self.head:  # the encoder's init: normal(0, 0.02)
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)

    def forward(self, idx, mask):
        hidden = self.encoder(idx, mask)  # (B, T, width)
        return self.head(self.pooler(hidden[:, 0])).float()


def learning_rate(step, total, peak):
    warmup = int(WARMUP * total)
    if step < warmup:
        return peak * step / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def finetune(ckpt, task, train, devs, args, trial, device, pad):
    """Fine-tune a fresh copy of the checkpoint on one task; {dev split: {metric: value}}."""
    torch.manual_seed(args.seed + trial)  # the model's head, dropout and the order of examples
    labels = TASKS[task][4]
    encoder = load_model(ckpt, args.ckpt, dropout=DROPOUT)
    if args.random_init:  # the same model from random weights: the "no pretraining" row
        encoder = Crammed(encoder.config)
    model = Classifier(encoder, 1 if labels is None else len(labels)).to(device)
    # bf16 needs no loss scaling; on the CPU autocast is off and everything stays fp32
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY, fused=True)  # 5x faster on CPUs too
    n = len(train[0])
    per_epoch = math.ceil(n / args.batch_size)
    progress = Progress(f"{task} trial {trial + 1}/{args.trials}", args.epochs * n, "ex")
    for epoch in range(args.epochs):
        loss_sum = torch.zeros((), device=device)  # summed on the device: no sync every step
        for i, (x, mask, y) in enumerate(
                batches(*train, torch.randperm(n), args.batch_size, pad, device), 1):
            lr = learning_rate(epoch * per_epoch + i - 1, args.epochs * per_epoch, args.lr)
            opt.param_groups[0]["lr"] = lr
            with torch.autocast(**amp):
                out = model(x, mask)
            loss = F.mse_loss(out[:, 0], y.float()) if labels is None else F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
            if i == per_epoch or time.time() - progress.last >= progress.every:
                extra = f" | epoch {epoch + 1}/{args.epochs} | loss {loss_sum.item() / i:.4f}"
                progress(epoch * n + min(i * args.batch_size, n), f"{extra} | lr {lr:.2e}", True)
    model.eval()
    results = {}
    with torch.no_grad(), torch.autocast(**amp):
        for split, (ids, ys) in devs.items():
            out = torch.cat([model(x, mask).cpu() for x, mask, _ in
                             batches(ids, ys, torch.arange(len(ids)), 128, pad, device)])
            pred = out[:, 0] if labels is None else out.argmax(-1)
            results[split] = score(task, pred.numpy(), ys.numpy())
    return results


# ----------------------------------------------------------------------------- results
def glue_score(results):
    """Mean of the paper's nine numbers over the ones present, and which those are."""
    have = [(s, m) for s, m in COLUMNS if s in results]
    avg = float(np.mean([results[s][m] for s, m in have])) if have else None
    return avg, [s for s, _ in have]


def print_table(name, results):
    """Our row and the paper's, the nine numbers in COLUMNS order (-: not run), then GLUE."""
    avg, over = glue_score(results)
    rows = {name: [results[s][m] if s in results else None for s, m in COLUMNS] + [avg]}
    rows.update({label: v + [np.mean(v)] for label, v in REFERENCE.items()})
    print(f"\n{'model':29s}" + "".join(f"{s:>8s}" for s, _ in COLUMNS) + "    GLUE")
    for label, values in rows.items():
        print(f"{label:29s}" + "".join("       -" if v is None else f"{v:8.1f}" for v in values))
    if 0 < len(over) < len(COLUMNS):
        print(f"note: the GLUE score here is the mean over {', '.join(over)} only")


def save(path, mine):
    """Merge this run's finished tasks into the results file, read again under a lock so that
    another glue.py that saved meanwhile keeps its tasks; with none finished, only check it."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(path + ".lock", "w")
    except OSError as e:
        die(f"{e.filename or path}: cannot write the results there ({e.strerror})")
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits while another run saves; released at close
        data = {"results": {}, "trials": {}, "settings": {}}
        try:
            if os.path.exists(path):
                with open(path) as f:
                    data = json.load(f)
            for key, value in mine.items():
                data[key].update(value)  # a rerun of a task replaces that task only
            data["average"], data["average_over"] = glue_score(data["results"])
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            die(f"{path}: not a glue.py results file ({type(e).__name__}); move it aside")
        if mine["results"]:
            write_atomic(path, json.dumps(data, indent=1).encode())
    return data


# ----------------------------------------------------------------------------- main
def get_args(argv):
    ap = Parser(__doc__, LIMITS)
    arg = ap.add_argument
    arg("--ckpt", required=True, help="cram checkpoint to fine-tune")
    arg("--out", help="results file (default: glue.json next to the checkpoint)")
    arg("--glue-dir", default="data/glue", help="GLUE task folders (default: %(default)s)")
    arg("--tasks", default="CoLA,SST-2,MRPC,STS-B,QQP,MNLI,QNLI,RTE",
        help="comma-separated, any case; WNLI too (default: %(default)s)")
    arg("--epochs", type=int, default=EPOCHS, help="per task (default: %(default)s)")
    arg("--lr", type=float, default=LR, help="peak AdamW lr (default: %(default)s)")
    arg("--batch-size", type=int, default=BATCH_SIZE, help="(default: %(default)s)")
    arg("--seed", type=int, default=0, help="trial k uses seed + k - 1 (default: %(default)s)")
    arg("--trials", type=int, default=TRIALS, help="runs; median reported (default: %(default)s)")
    arg("--max-len", type=int, default=MAX_LEN, help="tokens per example (default: %(default)s)")
    arg("--device", help="cpu, cuda, cuda:1, ... (default: cuda if there is one)")
    arg("--random-init", action="store_true", help="no pretraining; into glue-random-init.json")
    args = ap.parse_args(argv)
    known = {t.lower(): t for t in TASKS}  # any case: sst-2, SST-2 and Sst-2 are SST-2
    asked = [t.strip().lower() for t in args.tasks.split(",") if t.strip()]
    if not asked or not set(asked) <= set(known):
        die(f"--tasks {args.tasks}: name one or more of {','.join(TASKS)}")
    args.tasks = list(dict.fromkeys(known[t] for t in asked))
    name = "glue-random-init.json" if args.random_init else "glue.json"
    args.out = os.path.abspath(args.out or os.path.join(os.path.dirname(args.ckpt), name))
    return args


@entry
def main(argv=None):
    args = get_args(argv)
    ckpt = load_checkpoint(args.ckpt)
    seq_len = ckpt["model_config"]["seq_len"]
    if args.max_len > seq_len:  # the model has no position embedding beyond that
        die(f"--max-len {args.max_len}: must be at most {seq_len}, the checkpoint's seq_len")
    device = pick_device(args.device)
    mine = {"results": {}, "trials": {}, "settings": {}}  # this run's finished tasks
    save(args.out, mine)  # a results file that cannot be read or written fails now
    data = {}
    for task in args.tasks:  # every file first: a bad one should fail now, not hours into the run
        folder = ensure_task(task, args.glue_dir)
        data[task] = {s: read_tsv(os.path.join(folder, f), task)
                      for s, f in {"train": "train.tsv", **DEV[task]}.items()}
    enc, specials = load_tokenizer(ckpt["tokenizer"]), ckpt["tokenizer"]["special_tokens"]
    results, trials = mine["results"], mine["trials"]
    for task in args.tasks:
        splits = {s: encode(enc, specials, r, args.max_len) for s, r in data.pop(task).items()}
        train = splits.pop("train")
        runs = [finetune(ckpt, task, train, splits, args, k, device, specials["[PAD]"])
                for k in range(args.trials)]
        for split in splits:
            trials[split] = [r[split] for r in runs]
            results[split] = {m: float(np.median([r[m] for r in trials[split]]))
                              for m in runs[0][split]}
            print(f"{split}: " + ", ".join(f"{m} {v:.2f}" for m, v in results[split].items()))
        mine["settings"][task] = {k: v for k, v in vars(args).items() if k != "tasks"}
        saved = save(args.out, mine)  # after every task: a long run keeps what it finished
    name = os.path.basename(args.ckpt)
    print_table(f"random init ({name})" if args.random_init else name, saved["results"])
    print(f"wrote {args.out}")
    return saved["results"]


if __name__ == "__main__":
    main()
