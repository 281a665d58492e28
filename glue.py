"""
glue.py: fine-tune a crammed checkpoint on GLUE with the paper's "sane" recipe, print its table.
Missing GLUE files are downloaded, and all of them are checked before any fine-tuning. Results
merge into glue.json next to the checkpoint: a task run again replaces only that task.

    python glue.py --ckpt out/ckpt.pt                       # the eight tasks of the paper
    python glue.py --ckpt out/ckpt.pt --tasks rte,mrpc --trials 5
    python glue.py --ckpt out/ckpt.pt --random-init         # the "no pretraining" row
"""
import argparse, json, math, os, time, zipfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from prepare import Parser, Progress, die, download, load_tokenizer, normalize
from cram import ModelConfig, Crammed, load_checkpoint, load_model, pick_device

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

GLUE_URL = "https://dl.fbaipublicfiles.com/glue/data/{}.zip"
MRPC_URL = "https://dl.fbaipublicfiles.com/senteval/senteval_data/msr_paraphrase_train.txt"
MRPC_DEV_IDS_URL = ("https://firebasestorage.googleapis.com/v0/b/mtl-sentence-representations"
                    ".appspot.com/o/data%2Fmrpc_dev_ids.tsv?alt=media&token="
                    "ec5c0836-31d5-48f4-b431-7480817f1adc")
# task: (zip name, first text column, second text column, label column, labels; None = regression)
TASKS = {
    "CoLA": ("CoLA", "sentence", None, "label", ["0", "1"]),
    "SST-2": ("SST-2", "sentence", None, "label", ["0", "1"]),
    "MRPC": (None, "#1 String", "#2 String", "Quality", ["0", "1"]),
    "STS-B": ("STS-B", "sentence1", "sentence2", "score", None),
    "QQP": ("QQP-clean", "question1", "question2", "is_duplicate", ["0", "1"]),
    "MNLI": ("MNLI", "sentence1", "sentence2", "gold_label",
             ["entailment", "neutral", "contradiction"]),
    "QNLI": ("QNLIv2", "question", "sentence", "label", ["entailment", "not_entailment"]),
    "RTE": ("RTE", "sentence1", "sentence2", "label", ["entailment", "not_entailment"]),
    "WNLI": ("WNLI", "sentence1", "sentence2", "label", ["0", "1"]),
}
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


def task_name(name):
    """'sst2', 'SST-2', 'Sst-2' -> 'SST-2'."""
    known = {t.lower().replace("-", ""): t for t in TASKS}
    key = name.strip().lower().replace("-", "")
    if key not in known:
        die(f"unknown GLUE task {name!r}: choose from {','.join(known)}")
    return known[key]


# ----------------------------------------------------------------------------- data files
def write_atomic(path, data):
    """Write beside path, then rename: a half-written file never looks complete."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def fetch(url, path, folder, need):
    try:
        return download(url, path)
    except SystemExit as e:  # say what a user without network access can do instead
        die(f"{str(e.code).removeprefix('error: ')}; put that file at {path}, "
            f"or {', '.join(need)} in {folder}")


def build_mrpc(folder, need):
    """GLUE builds MRPC itself: SentEval's train file, split into train/dev by dev id pairs."""
    src = fetch(MRPC_URL, os.path.join(folder, "msr_paraphrase_train.txt"), folder, need)
    ids = fetch(MRPC_DEV_IDS_URL, os.path.join(folder, "mrpc_dev_ids.tsv"), folder, need)
    with open(ids, encoding="utf-8-sig") as f:
        dev_ids = {tuple(line.split()) for line in f}
    with open(src, encoding="utf-8") as f:  # the header keeps its BOM, as in GLUE's files
        header = f.readline().rstrip("\r\n")
        out = {"train.tsv": [header], "dev.tsv": [header]}
        for n, line in enumerate(f, 2):
            row = line.strip().split("\t")
            if len(row) != 5:
                die(f"{src}:{n}: expected 5 tab-separated columns, found {len(row)}")
            out["dev.tsv" if (row[1], row[2]) in dev_ids else "train.tsv"].append("\t".join(row))
    for name, lines in out.items():
        write_atomic(os.path.join(folder, name), ("\n".join(lines) + "\n").encode())


def ensure_task(task, glue_dir):
    """The task's folder with train and dev tsv files in it, downloading them if missing."""
    folder = os.path.join(glue_dir, task)
    need = ["train.tsv", *DEV[task].values()]
    if all(os.path.exists(os.path.join(folder, f)) for f in need):
        return folder
    if task == "MRPC":
        build_mrpc(folder, need)
        return folder
    zpath = os.path.join(glue_dir, TASKS[task][0] + ".zip")
    fetch(GLUE_URL.format(TASKS[task][0]), zpath, folder, need)
    try:
        with zipfile.ZipFile(zpath) as z:
            # shallowest first, so that RTE/train.tsv wins over RTE/original/train.tsv
            members = sorted(z.namelist(), key=lambda m: m.count("/"))
            for name in need:
                found = [m for m in members if os.path.basename(m) == name]
                if not found:
                    die(f"{zpath} has no {name}")
                write_atomic(os.path.join(folder, name), z.read(found[0]))
    except zipfile.BadZipFile:
        die(f"{zpath} is not a valid zip file; delete it and run again")
    os.remove(zpath)
    return folder


def read_tsv(path, task):
    """[(text a, text b or None, label)] from a GLUE tsv file, checking every row."""
    _, col_a, col_b, col_y, labels = TASKS[task]
    if not os.path.exists(path):
        die(f"missing GLUE file {path}")
    rows = []
    # tab separated, no quoting; utf-8-sig drops MRPC's BOM; newline="\n" keeps a stray \r
    with open(path, encoding="utf-8-sig", newline="\n") as f:
        header = COLA_HEADER if task == "CoLA" else f.readline().rstrip("\r\n").split("\t")
        for c in (col_a, col_b, col_y):
            if c and c not in header:
                die(f"{path}:1: no column {c!r} in the header (is this GLUE {task}?)")
        for n, line in enumerate(f, 1 if task == "CoLA" else 2):
            fields = line.rstrip("\r\n").split("\t")
            if fields == [""]:
                continue  # a blank line
            if len(fields) != len(header):
                die(f"{path}:{n}: expected {len(header)} tab-separated columns, "
                    f"found {len(fields)}")
            row = dict(zip(header, fields))
            y = row[col_y]
            if labels is not None and y not in labels:
                die(f"{path}:{n}: unknown label {y!r}, expected one of {', '.join(labels)}")
            try:
                y = float(y) if labels is None else labels.index(y)
            except ValueError:
                die(f"{path}:{n}: {col_y} {y!r} is not a number")
            rows.append((row[col_a], row[col_b] if col_b else None, y))
    if not rows:
        die(f"{path}: no examples")
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
    """1-based ranks, ties sharing their average rank."""
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
    """The crammed encoder, v2's pooler on the first token ([CLS], "zero_index") or on the mean
    of the real tokens ("avg", the v2 architecture's own default), and a linear head."""

    def __init__(self, encoder, n_out, pool="first"):
        super().__init__()
        self.encoder, self.pool = encoder, pool
        width = encoder.config.width
        self.pooler = nn.Sequential(nn.Linear(width, HEAD_DIM), nn.Tanh(), nn.Dropout(DROPOUT))
        self.head = nn.Linear(HEAD_DIM, n_out)
        for m in self.pooler[0], self.head:  # the encoder's init: normal(0, 0.02)
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)

    def forward(self, idx, mask):
        hidden = self.encoder(idx, mask)  # (B, T, width)
        if self.pool == "first":
            return self.head(self.pooler(hidden[:, 0])).float()
        real = mask[..., None].to(hidden.dtype)  # (B, T, 1): padding does not count
        return self.head(self.pooler((hidden * real).sum(1) / real.sum(1))).float()


def learning_rate(step, total, peak):
    warmup = int(WARMUP * total)
    if step < warmup:
        return peak * step / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def finetune(ckpt, task, train, devs, args, trial, device, pad):
    """Fine-tune a fresh copy of the checkpoint on one task; {dev split: {metric: value}}."""
    torch.manual_seed(args.seed + trial)
    shuffle = torch.Generator().manual_seed(args.seed + trial)
    labels = TASKS[task][4]
    if args.random_init:  # the same model from random weights: the "no pretraining" row
        encoder = Crammed(ModelConfig(**{**ckpt["model_config"], "dropout": DROPOUT}))
    else:
        encoder = load_model(ckpt, args.ckpt, dropout=DROPOUT)
    model = Classifier(encoder, 1 if labels is None else len(labels), args.pool).to(device)
    # bf16 needs no loss scaling; on the CPU autocast is off and everything stays fp32
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY, fused=True)  # 5x faster on CPUs too
    n = len(train[0])
    per_epoch = math.ceil(n / args.batch_size)
    progress = Progress(f"{task} trial {trial + 1}/{args.trials}", args.epochs * n, "ex")
    step = seen = 0
    for epoch in range(args.epochs):
        loss_sum = torch.zeros((), device=device)  # summed on the device: no sync every step
        order = torch.randperm(n, generator=shuffle)
        for i, (x, mask, y) in enumerate(batches(*train, order, args.batch_size, pad, device), 1):
            lr = learning_rate(step, args.epochs * per_epoch, args.lr)
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast(**amp):
                out = model(x, mask)
            loss = F.mse_loss(out[:, 0], y.float()) if labels is None else F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            seen += len(y)
            loss_sum += loss.detach()
            if i == per_epoch or time.time() - progress.last >= progress.every:
                mean = loss_sum.item() / i
                extra = f" | epoch {epoch + 1}/{args.epochs} | loss {mean:.4f} | lr {lr:.2e}"
                progress(seen, extra, force=True)
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
    ours = [results[s][m] if s in results else None for s, m in COLUMNS] + [avg]
    rows = [(name, ours)] + [(label, v + [np.mean(v)]) for label, v in REFERENCE.items()]
    names = [s for s, _ in COLUMNS[2:]] + ["GLUE"]
    print(f"\n{'model':30s} {'MNLI m/mm':>11s} " + " ".join(f"{s:>6s}" for s in names))
    for label, values in rows:
        cells = ["-" if v is None else f"{v:.1f}" for v in values]
        rest = " ".join(f"{c:>6s}" for c in cells[2:])
        print(f"{label:30s} {cells[0] + '/' + cells[1]:>11s} {rest}")
    if 0 < len(over) < len(COLUMNS):
        print(f"note: the GLUE score here is the mean over {', '.join(over)} only")


def load_results(path):
    """(results, trials, settings) of earlier runs in path, so that no finished task is lost."""
    if not os.path.exists(path):
        return {}, {}, {}
    try:
        with open(path) as f:
            data = json.load(f)
        results = {s: data[s] for t in TASKS for s in DEV[t] if s in data}
        glue_score(results)  # every number the table needs is there
        return results, dict(data.get("trials", {})), dict(data.get("settings", {}))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        die(f"{path}: not a glue.py results file ({type(e).__name__}); move it aside to start anew")


def save(path, results, trials, settings):
    """Rewritten after every task, so a long run keeps what it has finished."""
    avg, over = glue_score(results)
    data = {**results, "average": avg, "average_over": over, "trials": trials, "settings": settings}
    try:
        write_atomic(path, json.dumps(data, indent=1).encode())
    except OSError as e:
        die(f"{e.filename or path}: cannot write the results there ({e.strerror})")


# ----------------------------------------------------------------------------- main
def get_args(argv):
    ap = Parser(__doc__, {})
    arg = ap.add_argument
    arg("--ckpt", required=True, help="cram checkpoint to fine-tune")
    arg("--out", help="results file (default: glue.json next to the checkpoint)")
    arg("--glue-dir", default="data/glue", help="GLUE task folders (default: %(default)s)")
    arg("--tasks", default="cola,sst2,mrpc,stsb,qqp,mnli,qnli,rte",
        help="comma-separated, any case; wnli too (default: %(default)s)")
    arg("--epochs", type=int, default=EPOCHS, help="per task (default: %(default)s)")
    arg("--lr", type=float, default=LR, help="peak AdamW lr (default: %(default)s)")
    arg("--batch-size", type=int, default=BATCH_SIZE, help="(default: %(default)s)")
    arg("--seed", type=int, default=0, help="trial k uses seed + k - 1 (default: %(default)s)")
    arg("--trials", type=int, default=TRIALS, help="runs; median reported (default: %(default)s)")
    arg("--max-len", type=int, default=MAX_LEN, help="tokens per example (default: %(default)s)")
    arg("--device", help="cpu, cuda, cuda:1, ... (default: cuda if there is one)")
    arg("--random-init", action="store_true", help="no pretraining; into glue-random-init.json")
    arg("--pool", choices=["first", "mean"], default="first", help="first token (the recipe) or "
        "the mean (for the CPU demo's ALiBi model, whose first token sees only its neighbours)")
    args = ap.parse_args(argv)
    checks = [("epochs", args.epochs >= 1, "at least 1"),
              ("lr", 0 < args.lr <= 1, "above 0 and at most 1"),
              ("batch-size", args.batch_size >= 1, "at least 1"),
              ("trials", args.trials >= 1, "at least 1"),
              ("seed", 0 <= args.seed < 2 ** 32, "from 0 to 2**32 - 1"),
              ("max-len", args.max_len >= 4, "at least 4")]  # [CLS] a [SEP] b [SEP]
    for flag, ok, allowed in checks:
        if not ok:
            die(f"--{flag} {getattr(args, flag.replace('-', '_'))}: must be {allowed}")
    args.tasks = list(dict.fromkeys(task_name(t) for t in args.tasks.split(",") if t.strip()))
    if not args.tasks:
        die("--tasks: name at least one task")
    name = "glue-random-init.json" if args.random_init else "glue.json"
    args.out = os.path.abspath(args.out or os.path.join(os.path.dirname(args.ckpt), name))
    return args


def main(argv=None):
    args = get_args(argv)
    ckpt = load_checkpoint(args.ckpt)
    seq_len = ckpt["model_config"]["seq_len"]
    if args.max_len > seq_len:  # the model has no position embedding beyond that
        die(f"--max-len {args.max_len}: must be from 4 to {seq_len}, the checkpoint's length")
    device = pick_device(args.device)
    results, trials, settings = load_results(args.out)
    save(args.out + ".probe", results, trials, settings)  # unwritable? fail now, not hours later
    os.remove(args.out + ".probe")
    data = {}
    for task in args.tasks:  # every file first: a bad one should fail now, not hours into the run
        print(f"{task}: reading its files in {args.glue_dir}", flush=True)
        try:
            folder = ensure_task(task, args.glue_dir)
        except OSError as e:
            die(f"{e.filename or args.glue_dir}: {e.strerror}")
        data[task] = {s: read_tsv(os.path.join(folder, f), task)
                      for s, f in {"train": "train.tsv", **DEV[task]}.items()}
    enc = load_tokenizer(ckpt["tokenizer"])
    specials = ckpt["tokenizer"]["special_tokens"]
    for task in args.tasks:
        print(f"{task}: encoding {sum(map(len, data[task].values())):,} examples", flush=True)
        splits = {s: encode(enc, specials, rows, args.max_len)
                  for s, rows in data.pop(task).items()}
        train = splits.pop("train")
        runs = [finetune(ckpt, task, train, splits, args, k, device, specials["[PAD]"])
                for k in range(args.trials)]
        for split in splits:
            trials[split] = [r[split] for r in runs]
            results[split] = {m: float(np.median([r[m] for r in trials[split]]))
                              for m in runs[0][split]}
            shown = ", ".join(f"{m} {v:.2f}" for m, v in results[split].items())
            print(f"{split}: {shown}", flush=True)
        settings[task] = {k: v for k, v in vars(args).items() if k != "tasks"}
        save(args.out, results, trials, settings)
    name = os.path.basename(args.ckpt)
    print_table(f"random init ({name})" if args.random_init else name, results)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
