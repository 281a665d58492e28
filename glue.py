"""
glue.py: fine-tune a crammed checkpoint on GLUE with the paper's "sane" recipe, print its table.

Every task starts fresh from the checkpoint: 5 epochs, batch 16, AdamW lr 4e-5, cosine decay
with 10% warmup, dropout 0.1, a small head on the first token, scored on dev after the last
epoch. Missing GLUE files are downloaded from the addresses the standard GLUE script uses.

    python glue.py --ckpt out/ckpt.pt                       # the eight tasks of the paper
    python glue.py --ckpt out/ckpt.pt --tasks rte,mrpc --trials 5
    python glue.py --ckpt out/ckpt.pt --random-init         # the "no pretraining" row
"""
import argparse, json, math, os, shutil, time, zipfile
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from prepare import die, download, load_tokenizer, normalize, rate
from cram import ModelConfig, Crammed, load_checkpoint, pick_device

GLUE_URL = "https://dl.fbaipublicfiles.com/glue/data/{}.zip"
MRPC_URL = "https://dl.fbaipublicfiles.com/senteval/senteval_data/msr_paraphrase_train.txt"
MRPC_DEV_IDS_URL = ("https://firebasestorage.googleapis.com/v0/b/mtl-sentence-representations.appspot.com/o/"
                    "data%2Fmrpc_dev_ids.tsv?alt=media&token=ec5c0836-31d5-48f4-b431-7480817f1adc")

# task: (zip name, first text column, second text column, label column, labels; None = regression)
TASKS = {
    "CoLA": ("CoLA", "sentence", None, "label", ["0", "1"]),
    "SST-2": ("SST-2", "sentence", None, "label", ["0", "1"]),
    "MRPC": (None, "#1 String", "#2 String", "Quality", ["0", "1"]),
    "STS-B": ("STS-B", "sentence1", "sentence2", "score", None),
    "QQP": ("QQP-clean", "question1", "question2", "is_duplicate", ["0", "1"]),
    "MNLI": ("MNLI", "sentence1", "sentence2", "gold_label", ["entailment", "neutral", "contradiction"]),
    "QNLI": ("QNLIv2", "question", "sentence", "label", ["entailment", "not_entailment"]),
    "RTE": ("RTE", "sentence1", "sentence2", "label", ["entailment", "not_entailment"]),
    "WNLI": ("WNLI", "sentence1", "sentence2", "label", ["0", "1"]),
}
COLA_HEADER = ["source", "label", "original_label", "sentence"]  # CoLA's files have no header line
DEV = {"MNLI": {"MNLI-m": "dev_matched.tsv", "MNLI-mm": "dev_mismatched.tsv"}}  # others: {task: dev.tsv}
METRICS = {"CoLA": ["mcc"], "STS-B": ["pearson", "spearman"], "MRPC": ["f1", "accuracy"], "QQP": ["f1", "accuracy"]}
# The paper's table: its column order, and the nine numbers whose mean is the GLUE score.
COLUMNS = [("MNLI-m", "accuracy"), ("MNLI-mm", "accuracy"), ("SST-2", "accuracy"), ("STS-B", "pearson"),
           ("RTE", "accuracy"), ("QNLI", "accuracy"), ("QQP", "f1"), ("MRPC", "f1"), ("CoLA", "mcc")]
REFERENCE = [("BERT-base, fully trained", [83.2, 83.4, 91.9, 86.7, 59.2, 90.6, 87.7, 89.3, 56.5], 80.9),
             ("BERT-base, no pretraining", [34.1, 34.1, 79.9, 17.8, 47.3, 50.0, 68.6, 77.9, 0.0], 45.5),
             ("crammed BERT v1 (A6000, 24h)", [83.9, 84.1, 92.2, 84.6, 53.8, 89.5, 87.3, 87.5, 44.5], 78.6),
             ("crammed BERT v2 (best of 5)", [84.1, 84.6, 92.0, 87.4, 58.5, 90.2, 87.5, 88.9, 53.3], 80.7)]


def task_name(name):
    """'sst2', 'SST-2', 'Sst-2' -> 'SST-2'."""
    key = {t.lower().replace("-", ""): t for t in TASKS}
    if name.strip().lower().replace("-", "") not in key:
        die(f"unknown GLUE task {name!r}: choose from {','.join(key)}")
    return key[name.strip().lower().replace("-", "")]


# ----------------------------------------------------------------------------- data files
def fetch(url, path, folder, need):
    try:
        return download(url, path)
    except SystemExit as e:  # say what a user without network access can do instead
        die(f"{str(e.code).removeprefix('error: ')}; put that file at {path}, or {', '.join(need)} in {folder}")


def build_mrpc(folder, need):
    """GLUE builds MRPC itself: SentEval's train file, split into train/dev by a list of dev id pairs."""
    src = fetch(MRPC_URL, os.path.join(folder, "msr_paraphrase_train.txt"), folder, need)
    ids = fetch(MRPC_DEV_IDS_URL, os.path.join(folder, "mrpc_dev_ids.tsv"), folder, need)
    with open(ids, encoding="utf-8-sig") as f:
        dev_ids = {tuple(line.split()) for line in f if line.strip()}
    with open(src, encoding="utf-8") as f:  # the header keeps its BOM, as in GLUE's files
        header = f.readline().rstrip("\r\n") + "\n"
        out = {"train.tsv": [header], "dev.tsv": [header]}
        for n, line in enumerate(f, 2):
            row = line.strip().split("\t")
            if len(row) != 5:
                die(f"{src}:{n}: expected 5 tab-separated columns, found {len(row)}")
            out["dev.tsv" if (row[1], row[2]) in dev_ids else "train.tsv"].append("\t".join(row) + "\n")
    for name, lines in out.items():
        with open(os.path.join(folder, name + ".tmp"), "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))


def ensure_task(task, glue_dir):
    """The task's folder with train and dev tsv files in it, downloading them if missing."""
    folder = os.path.join(glue_dir, task)
    need = ["train.tsv", *DEV.get(task, {task: "dev.tsv"}).values()]
    if all(os.path.exists(os.path.join(folder, f)) for f in need):
        return folder
    if task == "MRPC":
        build_mrpc(folder, need)
        return folder
    zpath = fetch(GLUE_URL.format(TASKS[task][0]), os.path.join(glue_dir, TASKS[task][0] + ".zip"), folder, need)
    os.makedirs(folder, exist_ok=True)
    try:
        with zipfile.ZipFile(zpath) as z:
            for name in need:  # the shallowest member of that name, e.g. QQP/train.tsv
                found = sorted((m for m in z.namelist() if m.rsplit("/", 1)[-1] == name), key=lambda m: m.count("/"))
                if not found:
                    die(f"{zpath} has no {name}")
                # extract next to the target and rename: a half-written file never looks complete
                with z.open(found[0]) as src, open(os.path.join(folder, name + ".tmp"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))
    except zipfile.BadZipFile:
        die(f"{zpath} is not a valid zip file; delete it and run again")
    os.remove(zpath)
    return folder


def read_tsv(path, task):
    """[(text a, text b or None, label)] from a GLUE tsv file, checking every row."""
    _, col_a, col_b, col_y, labels = TASKS[task]
    if not os.path.exists(path):
        die(f"missing GLUE file {path}")
    header, rows = (COLA_HEADER if task == "CoLA" else None), []
    # tab separated, no quoting; utf-8-sig drops MRPC's BOM; newline="\n" keeps a stray \r inside a field
    with open(path, encoding="utf-8-sig", newline="\n") as f:
        for n, line in enumerate(f, 1):
            fields = line.rstrip("\r\n").split("\t")
            if header is None:
                header = fields
                for c in (col_a, col_b, col_y):
                    if c and c not in header:
                        die(f"{path}:1: no column {c!r} in the header (is this the GLUE {task} file?)")
                continue
            if not line.strip("\r\n"):
                continue
            if len(fields) != len(header):
                die(f"{path}:{n}: expected {len(header)} tab-separated columns, found {len(fields)}")
            row = dict(zip(header, fields))
            y = row[col_y]
            if labels is None:
                try:
                    y = float(y)
                except ValueError:
                    die(f"{path}:{n}: {col_y} {y!r} is not a number")
            elif y not in labels:
                die(f"{path}:{n}: unknown label {y!r}, expected one of {', '.join(labels)}")
            else:
                y = labels.index(y)
            rows.append((row[col_a], row[col_b] if col_b else None, y))
    if not rows:
        die(f"{path}: no examples")
    return rows


def encode(enc, specials, rows, max_len):
    """`[CLS] a [SEP] b [SEP]` token lists, the longer text cut first so the pair fits max_len."""
    cls, sep = specials["[CLS]"], specials["[SEP]"]
    a = enc.encode_ordinary_batch([normalize(r[0]) for r in rows])
    b = enc.encode_ordinary_batch([normalize(r[1] or "") for r in rows])
    out = []
    for r, x, y in zip(rows, a, b):
        room = max_len - (2 if r[1] is None else 3)
        if len(x) + len(y) > room:  # what "longest first" truncation converges to
            short = min(len(x), len(y), room // 2)
            x, y = (x[:short], y[:room - short]) if len(x) <= len(y) else (x[:room - short], y[:short])
        out.append([cls] + x + [sep] + (y + [sep] if r[1] is not None else []))
    return out, torch.tensor([r[2] for r in rows])


def batches(ids, ys, order, batch_size, pad, device):
    """Each batch padded only to its longest row, with a mask saying which tokens are real."""
    for i in range(0, len(order), batch_size):
        rows = [ids[j] for j in order[i:i + batch_size]]
        lens = torch.tensor([len(r) for r in rows])
        x = torch.full((len(rows), int(lens.max())), pad, dtype=torch.long)
        for k, r in enumerate(rows):
            x[k, :len(r)] = torch.tensor(r)
        mask = torch.arange(x.shape[1])[None] < lens[:, None]
        yield x.to(device), mask.to(device), ys[order[i:i + batch_size]].to(device)


# ----------------------------------------------------------------------------- metrics (numpy)
def accuracy(p, y):
    return float(np.mean(np.asarray(p) == np.asarray(y)))


def confusion(p, y):
    p, y = np.asarray(p) == 1, np.asarray(y) == 1  # floats: products overflow int64 on QQP-sized sets
    return float(np.sum(p & y)), float(np.sum(~p & ~y)), float(np.sum(p & ~y)), float(np.sum(~p & y))


def f1(p, y):
    tp, tn, fp, fn = confusion(p, y)
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def mcc(p, y):
    tp, tn, fp, fn = confusion(p, y)
    d = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / d if d else 0.0  # a constant predictor scores 0, as sklearn says


def pearson(p, y):
    p, y = np.asarray(p, np.float64) - np.mean(p), np.asarray(y, np.float64) - np.mean(y)
    d = math.sqrt(np.sum(p * p) * np.sum(y * y))
    return float(np.sum(p * y) / d) if d else 0.0  # undefined for a constant; call it no correlation


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
def finetune(ckpt, task, train, devs, args, trial, device, pad):
    """Fine-tune a fresh copy of the checkpoint on one task; {dev split: {metric: value}}."""
    torch.manual_seed(args.seed + trial)
    shuffle = torch.Generator().manual_seed(args.seed + trial)
    regression = TASKS[task][4] is None
    cfg = ModelConfig(**{**ckpt["model_config"], "dropout": 0.1})
    body = Crammed(cfg)
    if not args.random_init:
        try:
            body.load_state_dict(ckpt["model"])
        except RuntimeError as e:
            die(f"{args.ckpt}: weights do not fit its model_config ({str(e).splitlines()[0]})")
    # the head reads the first ([CLS]) token: dense, tanh, dropout, linear
    head = nn.Sequential(nn.Linear(cfg.width, cfg.width), nn.Tanh(), nn.Dropout(0.1),
                         nn.Linear(cfg.width, 1 if regression else len(TASKS[task][4])))
    for m in head[0], head[3]:
        nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)
    model = nn.ModuleDict(dict(body=body, head=head)).to(device)
    forward = lambda x, mask: model["head"](model["body"](x, mask)[:, 0]).float()
    amp = (lambda: torch.autocast("cuda", torch.bfloat16)) if device.type == "cuda" else nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.0,
                            fused=True)  # on the CPU too: 5x faster than the default loop for small models
    n, per_epoch = len(train[0]), math.ceil(len(train[0]) / args.batch_size)
    total, warmup = args.epochs * per_epoch, int(0.1 * args.epochs * per_epoch)
    step, seen, t0, last, loss_sum, loss_n = 0, 0, time.time(), time.time(), torch.zeros((), device=device), 0
    for epoch in range(args.epochs):
        model.train()
        for x, mask, y in batches(*train, torch.randperm(n, generator=shuffle), args.batch_size, pad, device):
            # linear warmup, then cosine decay to zero at the last step
            lr = args.lr * (step / warmup if step < warmup else
                            0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1))))
            for g in opt.param_groups:
                g["lr"] = lr
            with amp():
                out = forward(x, mask)
            loss = F.mse_loss(out[:, 0], y.float()) if regression else F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step, seen, loss_sum, loss_n = step + 1, seen + len(y), loss_sum + loss.detach(), loss_n + 1
            if step % per_epoch == 0 or time.time() - last > 30:
                last = time.time()
                print(f"{task} trial {trial + 1}/{args.trials} epoch {epoch + 1}/{args.epochs} step {step}/{total}"
                      f" | loss {loss_sum.item() / loss_n:.4f} | lr {lr:.2e} | {rate(seen, n * args.epochs, t0, 'ex')}",
                      flush=True)
                loss_sum, loss_n = torch.zeros((), device=device), 0
    model.eval()
    results = {}
    with torch.no_grad(), amp():
        for split, (ids, ys) in devs.items():
            out = torch.cat([forward(x, mask).cpu() for x, mask, _ in
                             batches(ids, ys, torch.arange(len(ids)), 128, pad, device)])
            results[split] = score(task, out[:, 0].numpy() if regression else out.argmax(-1).numpy(), ys.numpy())
    return results


# ----------------------------------------------------------------------------- report
def glue_score(results):
    """Mean of the paper's nine numbers over the ones this run has, and which those are."""
    have = [(s, m) for s, m in COLUMNS if s in results]
    return (float(np.mean([results[s][m] for s, m in have])) if have else None), [s for s, _ in have]


def print_table(name, results):
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    row = lambda label, v, avg: (f"{label:30s} {fmt(v[0]) + '/' + fmt(v[1]):>11s} "
                                 + " ".join(f"{fmt(x):>6s}" for x in v[2:] + [avg]))
    avg, over = glue_score(results)
    print(f"\n{'model':30s} {'MNLI m/mm':>11s} " + " ".join(f"{c:>6s}" for c in
          ["SST-2", "STS-B", "RTE", "QNLI", "QQP", "MRPC", "CoLA", "GLUE"]))
    print(row(name, [results[s][m] if s in results else None for s, m in COLUMNS], avg))
    for label, v, ref in REFERENCE:
        print(row(label, v, ref))
    if 0 < len(over) < len(COLUMNS):
        print(f"note: this run's GLUE is the mean over {', '.join(over)} only, not all nine numbers")


def save(path, results, trials, args):
    avg, over = glue_score(results)
    data = {**results, "average": avg, "average_over": over, "trials": trials, "settings": vars(args)}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)  # rewritten after every task, so a long run keeps what it finished


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="cram checkpoint to fine-tune; glue.json is written next to it")
    ap.add_argument("--glue-dir", default="data/glue",
                    help="folder of <TASK>/train.tsv, dev.tsv; missing files are downloaded (default: %(default)s)")
    ap.add_argument("--tasks", default="cola,sst2,mrpc,stsb,qqp,mnli,qnli,rte",
                    help="comma-separated, any case, dash optional; wnli too (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=5, help="fine-tuning epochs per task (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=4e-5, help="peak AdamW learning rate (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=16, help="examples per optimizer step (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of trial 1; trial k uses seed + k - 1 (default: %(default)s)")
    ap.add_argument("--trials", type=int, default=1,
                    help="fine-tuning runs per task, the table shows the median; the paper uses 5 (default: %(default)s)")
    ap.add_argument("--max-len", type=int, default=128, help="tokens per example with [CLS], [SEP] (default: %(default)s)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    ap.add_argument("--random-init", action="store_true",
                    help="fine-tune the same architecture from random weights (no pretraining); writes glue-random-init.json")
    args = ap.parse_args(argv)
    tasks = list(dict.fromkeys(task_name(t) for t in args.tasks.split(",") if t.strip()))
    if not tasks:
        die("--tasks: name at least one task")
    for flag in ("epochs", "batch_size", "trials", "lr"):
        if not getattr(args, flag) > 0:
            die(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive")
    if args.max_len < 4:
        die(f"--max-len {args.max_len}: must be at least 4")
    for task in tasks:  # every file first: a missing one should fail now, not hours into the run
        ensure_task(task, args.glue_dir)
    ckpt = load_checkpoint(args.ckpt)
    if args.max_len > ckpt["model_config"]["seq_len"]:  # the model has no position embedding beyond that
        die(f"--max-len {args.max_len}: longer than the checkpoint's {ckpt['model_config']['seq_len']} positions")
    enc, specials = load_tokenizer(ckpt["tokenizer"]), ckpt["tokenizer"]["special_tokens"]
    device = pick_device(args.device)
    out = os.path.join(os.path.dirname(os.path.abspath(args.ckpt)),
                       "glue-random-init.json" if args.random_init else "glue.json")
    results, trials = {}, {}
    for task in tasks:
        t0, folder = time.time(), os.path.join(args.glue_dir, task)
        train = encode(enc, specials, read_tsv(os.path.join(folder, "train.tsv"), task), args.max_len)
        devs = {split: encode(enc, specials, read_tsv(os.path.join(folder, f), task), args.max_len)
                for split, f in DEV.get(task, {task: "dev.tsv"}).items()}
        print(f"{task}: {len(train[0]):,} train and {' + '.join(f'{len(d[0]):,}' for d in devs.values())} dev examples "
              f"({time.time() - t0:.1f}s to read), on {device}", flush=True)
        runs = [finetune(ckpt, task, train, devs, args, k, device, specials["[PAD]"]) for k in range(args.trials)]
        for split in devs:
            trials[split] = [r[split] for r in runs]
            results[split] = {m: float(np.median([r[m] for r in trials[split]])) for m in trials[split][0]}
            print(f"{split}: " + ", ".join(f"{m} {v:.2f}" for m, v in results[split].items())
                  + (f" (median of {args.trials} trials)" if args.trials > 1 else "") + f", {time.time() - t0:.0f}s",
                  flush=True)
        save(out, results, trials, args)
    print_table("this run, random init" if args.random_init else f"this run ({os.path.basename(args.ckpt)})", results)
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
