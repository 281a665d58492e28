"""glue.py: fine-tune a crammed checkpoint on GLUE with the paper's "sane" recipe, print its table.

    python glue.py --ckpt out/ckpt.pt [--tasks RTE,MRPC --trials 5]  # default: the paper's 8 tasks
    python glue.py --ckpt out/ckpt.pt --random-init                  # the "no pretraining" row"""
import argparse, collections, json, math, os, pathlib

import numpy as np, torch, torch.nn as nn, torch.nn.functional as F

from cram import BETAS, INIT_STD, MICRO_BATCH, Crammed, autocast, load_checkpoint, load_model
from cram import pick_device, to_device
from prepare import Progress, above_zero, atomic, damaged, die, entry, load_tokenizer, normalize

# ----------------------------------------------------------------------------- the "sane" recipe
LR = 4e-5            # peak AdamW learning rate
BATCH_SIZE = 16      # examples per optimizer step
EPOCHS = 5           # the challenge allows at most 5, one recipe for every task
WARMUP = 0.1         # linear warm-up over this fraction of the steps, then cosine decay to zero
EPS = 1e-6           # AdamW's epsilon; its betas are pretraining's (cram.BETAS), as in v2
WEIGHT_DECAY = 0.0   # none: five short epochs from a pretrained start
DROPOUT = 0.1        # in the encoder and the head while fine-tuning (pretraining has none)
HEAD_DIM = 1024      # v2's head_dim: first token -> dense to this width, tanh, dropout, linear
TRIALS = 1           # fine-tuning runs per task; the paper reports the median of 5
BUCKET = 32          # compiled, each batch is cut to a multiple of this: few shapes to compile

Task = collections.namedtuple("Task", "a b label labels")  # the columns of its tsv files
TASKS = {"CoLA": Task("sentence", None, "label", ["0", "1"]),  # b None: one sentence
         "SST-2": Task("sentence", None, "label", ["0", "1"]),
         "MRPC": Task("#1 String", "#2 String", "Quality", ["0", "1"]),
         "STS-B": Task("sentence1", "sentence2", "score", None),  # labels None: regression
         "QQP": Task("question1", "question2", "is_duplicate", ["0", "1"]),
         "MNLI": Task("sentence1", "sentence2", "gold_label",
                      ["entailment", "neutral", "contradiction"]),
         "QNLI": Task("question", "sentence", "label", ["entailment", "not_entailment"]),
         "RTE": Task("sentence1", "sentence2", "label", ["entailment", "not_entailment"]),
         "WNLI": Task("sentence1", "sentence2", "label", ["0", "1"])}
COLA_HEADER = ["source", "label", "original_label", "sentence"]  # CoLA's files have no header
DEV = {"MNLI": {"MNLI-m": "dev_matched.tsv", "MNLI-mm": "dev_mismatched.tsv"}}  # others: dev.tsv
METRICS = {"CoLA": ["mcc"], "STS-B": ["pearson"], "MRPC": ["f1", "accuracy"],
           "QQP": ["f1", "accuracy"]}
COLUMNS = ["MNLI-m", "MNLI-mm", "SST-2", "STS-B", "RTE", "QNLI", "QQP", "MRPC", "CoLA"]
REFERENCE = {  # the paper's rows, each with its GLUE score last
    "BERT-base, fully trained": [83.2, 83.4, 91.9, 86.7, 59.2, 90.6, 87.7, 89.3, 56.5, 80.9],
    "BERT-base, no pretraining": [34.1, 34.1, 79.9, 17.8, 47.3, 50.0, 68.6, 77.9, 0.0, 45.5],
    "crammed BERT v1 (A6000, 24h)": [83.9, 84.1, 92.2, 84.6, 53.8, 89.5, 87.3, 87.5, 44.5, 78.6],
    "crammed BERT v2 (best of 5)": [84.1, 84.6, 92.0, 87.4, 58.5, 90.2, 87.5, 88.9, 53.3, 80.7]}


# ----------------------------------------------------------------------------- the examples
def read_tsv(path, task):
    """[(text a, text b or None, label)] of a GLUE tsv: tabs, no quoting, lines cut at \\n only."""
    t, rows = TASKS[task], []
    try:
        lines = pathlib.Path(path).read_bytes().decode("utf-8-sig").split("\n")
    except FileNotFoundError:
        die(f"{path}: not there; --glue-dir wants the folders of GLUE's download_glue_data.py")
    except UnicodeDecodeError as e:
        damaged(path, e, "; GLUE's files are UTF-8")
    header = COLA_HEADER if task == "CoLA" else lines[0].rstrip("\r").split("\t")
    for n, line in enumerate(lines, 1):
        fields = line.rstrip("\r").split("\t")
        if fields != [""] and (n > 1 or task == "CoLA"):  # not a blank line, nor the header
            row = dict(zip(header, fields))
            y = row.get(t.label)  # None in a short row, or in the file of another task
            try:
                rows.append((row[t.a], row[t.b] if t.b else None,
                             float(y) if t.labels is None else t.labels.index(y)))
            except (KeyError, TypeError, ValueError):
                die(f"{path}:{n}: a text column is missing, or label {y!r} (column {t.label!r}) is "
                    f"not {t.labels or 'a number'}; is this {task}?")
    if not rows:
        die(f"{path}: no examples")
    return rows


def truncate(a, b, room):
    """Cut the longer of two token lists first until both fit in room ("longest first"). seq_len
    128, room 125 ([CLS] a [SEP] b [SEP] takes 3): lengths (100, 60) -> the shorter keeps
    min(60, 125 // 2) = 60, a the other 65; (100, 90) -> (63, 62). One sentence: b [], room 126."""
    short = min(len(a), len(b), room // 2)
    if len(a) <= len(b):
        return a[:short], b[:room - short]
    return a[:room - short], b[:short]


def encode(enc, specials, rows, seq_len):
    """`[CLS] a [SEP] b [SEP]` rows padded to the checkpoint's seq_len (no flag), and the labels."""
    cls, sep = specials["[CLS]"], specials["[SEP]"]
    a = enc.encode_ordinary_batch([normalize(r[0]) for r in rows])
    b = enc.encode_ordinary_batch([normalize(r[1] or "") for r in rows])
    ids = torch.full((len(rows), seq_len), specials["[PAD]"])
    for i, ((_, text_b, _), tokens_a, tokens_b) in enumerate(zip(rows, a, b)):
        pair = text_b is not None
        tokens_a, tokens_b = truncate(tokens_a, tokens_b, seq_len - 3 if pair else seq_len - 2)
        row = [cls] + tokens_a + [sep] + (tokens_b + [sep] if pair else [])
        ids[i, :len(row)] = torch.tensor(row)
    return ids, torch.tensor([r[2] for r in rows])


# ----------------------------------------------------------------------------- fine-tuning
class Classifier(nn.Module):
    """The crammed encoder, then v2's head on [CLS] ("zero_index") or on the mean (--pool mean)."""

    def __init__(self, encoder, n_out, pad, pool="first"):
        super().__init__()
        self.encoder, self.pad, self.pool = encoder, pad, pool
        self.head = nn.Sequential(nn.Linear(encoder.config.width, HEAD_DIM), nn.Tanh(),
                                  nn.Dropout(DROPOUT), nn.Linear(HEAD_DIM, n_out))
        for m in self.head[0], self.head[3]:
            nn.init.normal_(m.weight, std=INIT_STD)
            nn.init.zeros_(m.bias)

    def forward(self, idx):  # idx (B, T) cut by `bucket`: the model reads no length off the GPU
        not_pad = idx != self.pad
        h = self.encoder(idx, not_pad)  # (B, T, width)
        if self.pool == "mean":  # padding adds nothing to the sum, nor to the count
            return self.head((h * not_pad[..., None]).sum(1) / not_pad.sum(1, keepdim=True)).float()
        return self.head(h[:, 0]).float()


def bucket(rows, pad, multiple):
    """Rows cut on the CPU to the longest, rounded up to a multiple: 5 and 40 tokens -> 64 at 32,
    so a compiled model meets 4 lengths; 40 at 1, eager. Outputs equal: [PAD] only at the end."""
    longest = int((rows != pad).sum(1).max())
    return rows[:, :min(math.ceil(longest / multiple) * multiple, rows.size(1))]


def learning_rate(step, total, peak):
    warmup = int(WARMUP * total)
    if step < warmup:
        return peak * step / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


class Run:
    """What lasts from trial to trial: a classifier per head size, and the run's progress."""

    def __init__(self, examples, compile):
        self.compile, self.kept, self.done = compile, {}, 0
        self.progress = Progress("fine-tuning", examples, "ex")


def finetune(ckpt, task, train, devs, args, trial, device, run):
    """Fine-tune a fresh copy of the checkpoint on one task; {dev split: {metric: value}}."""
    torch.manual_seed(args.seed + trial)  # the model's head, dropout and the order of examples
    labels = TASKS[task].labels
    pad = ckpt["tokenizer"]["special_tokens"]["[PAD]"]
    encoder = load_model(ckpt, dropout=DROPOUT)
    if args.random_init:
        encoder = Crammed(encoder.config)
    n_out = 1 if labels is None else len(labels)
    fresh = Classifier(encoder, n_out, pad, args.pool)
    if n_out not in run.kept:  # the run's first head of this size: kept, and compiled once
        compiled = torch.compile(fresh, dynamic=False, fullgraph=True) if run.compile else None
        run.kept[n_out] = fresh.to(device), compiled
    model, compiled = run.kept[n_out]
    model.load_state_dict(fresh.state_dict())  # into the same tensors: the graphs stay valid
    model.train()  # the last trial left it in eval mode
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, eps=EPS, fused=True,
                            weight_decay=WEIGHT_DECAY)  # fused: torch has it on CPUs too
    ids, ys = train
    order = torch.cat([torch.randperm(len(ids)) for _ in range(args.epochs)])
    steps = math.ceil(len(order) / args.batch_size)
    for step, picked in enumerate(order.split(args.batch_size)):
        opt.param_groups[0]["lr"] = learning_rate(step, steps, args.lr)
        y = to_device(ys[picked], device)
        eager = compiled is None or len(picked) < args.batch_size  # the last batch: no new graph
        step_model, multiple = (model, 1) if eager else (compiled, BUCKET)  # eager: its longest row
        with autocast(device):
            out = step_model(to_device(bucket(ids[picked], pad, multiple), device))
        loss = F.mse_loss(out[:, 0], y) if labels is None else F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.done += len(picked)
        trial_loss = lambda: f" | {task} trial {trial + 1}/{args.trials}, loss {loss.item():.4f}"
        run.progress(run.done, trial_loss, force=step + 1 == steps)  # .item() waits: only if shown
    model.eval()
    scores = {}
    with torch.no_grad(), autocast(device):
        for split, (dev_ids, dev_ys) in devs.items():  # eager, a batch cut to its longest row
            out = torch.cat([model(to_device(bucket(rows, pad, 1), device)).cpu()
                             for rows in dev_ids.split(MICRO_BATCH)])
            preds = out[:, 0] if labels is None else out.argmax(-1)
            scores[split] = score(task, preds.numpy(), dev_ys.numpy())
    return scores


# ----------------------------------------------------------------------------- the metrics
def score(task, p, y):
    """The task's metrics x 100, of predictions p and labels y (0/1 labels: MCC is Pearson's r)."""
    dp, dy = [np.asarray(v, np.float64) - np.mean(v) for v in (p, y)]  # deviations from the mean
    d = math.sqrt(np.sum(dp * dp) * np.sum(dy * dy))
    r = np.sum(dp * dy) / d if d else 0.0  # Pearson's r; a constant: no correlation, not nan
    p, y = np.asarray(p), np.asarray(y)
    f1 = 2 * np.sum((p == 1) & (y == 1)) / max(np.sum(p == 1) + np.sum(y == 1), 1)  # 2tp/(|p|+|y|)
    found = {"accuracy": np.mean(p == y), "f1": f1, "mcc": r, "pearson": r}
    return {m: 100 * float(found[m]) for m in METRICS.get(task, ["accuracy"])}


def glue_score(results):
    """The paper's number of each split present, and their mean once all nine are there."""
    numbers = {s: results[s][METRICS.get(s, ["accuracy"])[0]] for s in COLUMNS if s in results}
    avg = float(np.mean(list(numbers.values()))) if len(numbers) == len(COLUMNS) else None
    return avg, numbers


# ----------------------------------------------------------------------------- plumbing
def read_task(task, glue_dir):
    files = {"train": "train.tsv", **DEV.get(task, {task: "dev.tsv"})}
    return {s: read_tsv(os.path.join(glue_dir, task, f), task) for s, f in files.items()}


def get_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    arg = ap.add_argument
    arg("--ckpt", required=True, help="the cram checkpoint to fine-tune; glue.json goes beside it")
    arg("--glue-dir", default="data/glue", help="GLUE's task folders (default: %(default)s)")
    arg("--tasks", default="CoLA,SST-2,MRPC,STS-B,QQP,MNLI,QNLI,RTE",
        help="GLUE tasks, comma-separated, in any case (default: the paper's 8, all but WNLI)")
    arg("--epochs", type=above_zero(int), default=EPOCHS, help="per task (default: %(default)s)")
    arg("--lr", type=above_zero(float), default=LR, help="peak AdamW lr (default: %(default)s)")
    arg("--batch-size", type=above_zero(int), default=BATCH_SIZE,
        help="examples per optimizer step (default: %(default)s)")
    arg("--seed", type=int, default=0, help="trial k uses seed + k - 1 (default: %(default)s)")
    arg("--trials", type=above_zero(int), default=TRIALS,
        help="fine-tuning runs per task; the table gives their median (default: %(default)s)")
    arg("--max-train-samples", type=above_zero(int), help="fine-tune on the first N examples (all)")
    arg("--device", help="cpu, cuda, cuda:1, ... (default: cuda if there is one)")
    arg("--no-compile", action="store_true", help="skip torch.compile (on by default on CUDA)")
    arg("--random-init", action="store_true", help="no pretraining; into glue-random-init.json")
    arg("--pool", choices=["first", "mean"], default="first",
        help="the head's input: v2's first token, or the tokens' mean (%(default)s)")
    args = ap.parse_args(argv)
    known = {t.lower(): t for t in TASKS}
    if not set(args.tasks.lower().split(",")) <= set(known):
        die(f"--tasks {args.tasks}: name one or more of {','.join(TASKS)}")
    args.tasks = [known[t] for t in args.tasks.lower().split(",")]
    return args


@entry
def main(argv=None):
    args = get_args(argv)
    device = pick_device(args.device)
    ckpt = load_checkpoint(args.ckpt)
    out = os.path.join(os.path.dirname(args.ckpt),
                       "glue-random-init.json" if args.random_init else "glue.json")
    data = {t: read_task(t, args.glue_dir) for t in args.tasks}
    open(out + ".tmp", "w").close()  # a folder that takes no file: said now, not after a task
    os.remove(out + ".tmp")
    enc, specials = load_tokenizer(ckpt["tokenizer"]), ckpt["tokenizer"]["special_tokens"]
    seq_len = ckpt["model_config"]["seq_len"]
    train_examples = sum(len(rows["train"][:args.max_train_samples]) for rows in data.values())
    examples = args.trials * args.epochs * train_examples
    print(f"fine-tuning on {examples:,} examples in all: {args.trials} trial(s) x {args.epochs} "
          f"epochs x {train_examples:,} training examples of {len(data)} task(s)")
    torch._dynamo.config.cache_size_limit = 3 * math.ceil(seq_len / BUCKET)  # head sizes x lengths
    run = Run(examples, compile=device.type == "cuda" and not args.no_compile)
    results = {}
    for task, rows in data.items():
        train = encode(enc, specials, rows.pop("train")[:args.max_train_samples], seq_len)
        devs = {s: encode(enc, specials, r, seq_len) for s, r in rows.items()}
        runs = [finetune(ckpt, task, train, devs, args, k, device, run) for k in range(args.trials)]
        for split in devs:
            trials = [r[split] for r in runs]
            results[split] = {m: float(np.median([t[m] for t in trials])) for m in trials[0]}
            results[split]["trials"] = trials
        avg, numbers = glue_score(results)
        with atomic(out, "w") as f:  # after each task: a Ctrl-C loses only the task at hand
            json.dump({"settings": vars(args), "results": results, "average": avg}, f, indent=1)
    ours = "random init" if args.random_init else os.path.basename(args.ckpt)
    print(f"\nours: the median of {args.trials} trial(s) per task; the paper's rows: medians of 5 "
          f"(--trials 5), v2's: the best of 5")
    print(f"{'model':29s}" + "".join(f"{s:>8s}" for s in [*COLUMNS, "GLUE"]))
    for label, values in {ours: [numbers.get(s) for s in COLUMNS] + [avg], **REFERENCE}.items():
        print(f"{label:29s}" + "".join("       -" if v is None else f"{v:8.1f}" for v in values))
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
