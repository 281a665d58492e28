"""figures/plot.py: the README's pictures, drawn from the runs' own files (needs matplotlib).

    pip install matplotlib
    python figures/plot.py run out --data data -o my_run.png       # any run: its losses over time
    python figures/plot.py lessons runs/lessons --data d2k -o figures/lessons.png
    python figures/plot.py budgets runs/t60_s0 runs/t180_s0 runs/demo -o figures/budgets.png

A run's folder holds log.jsonl (cram.py), and after fine-tuning glue.json and
glue-random-init.json (glue.py); `lessons` also reads the masking runs' ckpt.pt."""
import argparse, itertools, json, os, statistics, sys

import numpy as np, torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cram  # noqa: E402  (the scripts beside this folder)
from prepare import read_prepared  # noqa: E402

# each lesson, a panel: its x axis, and its variants as {label: run name} (folders name_s0, name_s1)
LESSONS = {
    "learning-rate schedule": ("step", {"triangle": "base", "no warm-up": "nowarmup",
                                        "no cool-down": "nocooldown", "constant": "constant"}),
    "masking rate (scored at 25%)": ("rate", {"15%": "mask15", "25%": "base", "40%": "mask40"}),
    "pre- or post-normalisation": ("step", {"pre": "base", "post": "postnorm"}),
    "ALiBi": ("elapsed", {"ALiBi": "t_base", "none": "t_noalibi"}),
    "model size": ("elapsed", {"1 x 96": "t_small", "2 x 128": "t_base", "4 x 192": "t_big"}),
    "batch size": ("elapsed", {"16": "t_base", "64": "t_b64", "256": "t_b256"}),
    "sparse prediction": ("elapsed", {"sparse": "t_base", "every position": "t_dense"}),
    "gated MLP": ("elapsed", {"gated": "t_base", "plain": "t_plain"}),
}
SEEDS = ["_s0", "_s1"]  # drawn solid and dashed
RECIPE = ["base", "t_base"]  # the recipe's runs: blue in every panel


def read_log(run):
    """The records of run/log.jsonl: the training steps, and the validations (val_loss)."""
    with open(os.path.join(run, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "loss" in r]
    return steps, [r for r in records if "val_loss" in r]


def unigram_entropy(data):
    """Nats: the loss of the best guess without context, the frequency of each ordinary token.
    A masked position never holds a special token ([SEP] ...), so they are left out."""
    meta, _, rows = read_prepared(data)
    counts = np.bincount(rows["train"].ravel(), minlength=meta["vocab_size"])
    ordinary = counts[:min(meta["special_tokens"].values())]  # the specials are the last ids
    p = ordinary[ordinary > 0] / ordinary.sum()
    return float(-(p * np.log(p)).sum())


def score_at_25(run, data):
    """(loss, accuracy) of run/ckpt.pt on the held-out rows, masked at cram.py's MASK_RATE."""
    meta, _, rows = read_prepared(data)
    model = cram.load_model(cram.load_checkpoint(os.path.join(run, "ckpt.pt")))
    return cram.evaluate(model, rows["val"], meta["special_tokens"], 64, torch.device("cpu"))


def draw_run(ax, run, label="", color=None, x="elapsed", style="-"):
    """Training loss (thin) and validation loss (dots) of one run, against seconds or steps."""
    steps, vals = read_log(run)
    scale = 60 if x == "minutes" else 1
    key = "elapsed" if x == "minutes" else x
    line, = ax.plot([r[key] / scale for r in steps], [r["loss"] for r in steps], style, lw=0.8,
                    color=color, label=label, alpha=0.7)
    ax.plot([r[key] / scale for r in vals], [r["val_loss"] for r in vals], "o",
            color=line.get_color(), ms=3)
    return vals[-1]["val_loss"] if vals else None


def plot_runs(args):
    """Any runs: losses against minutes, the unigram entropy as the plateau to beat."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    entropy = unigram_entropy(args.data)
    for run in args.runs:
        last = draw_run(ax, run, label=os.path.basename(run.rstrip("/")), x="minutes")
        print(f"{run}: last validation loss {last}")
    ax.plot([], [], "o", color="gray", ms=3, label="validation (the curves: training, as logged)")
    ax.axhline(entropy, color="gray", ls="--", lw=0.8)
    ax.text(0, entropy, f" unigram entropy {entropy:.3f}: no context", va="bottom", fontsize=8)
    ax.set(xlabel="minutes", ylabel="masked-LM loss (nats)", ylim=(None, entropy + 0.6))
    ax.legend(fontsize=8)
    return fig


def plot_lessons(args):
    """One panel per lesson: its variants, two seeds each (same colour), end validation as dots."""
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    entropy = unigram_entropy(args.data)
    for ax, (lesson, (x, variants)) in zip(axes.flat, LESSONS.items()):
        others = iter(range(1, 10))
        for i, (label, name) in enumerate(variants.items()):
            runs = [os.path.join(args.folder, name + seed) for seed in SEEDS]
            color = "C0" if name in RECIPE else f"C{next(others)}"
            if x == "rate":  # each rate validates on its own task: score the end on 25% masks
                losses = [score_at_25(run, args.data)[0] for run in runs]
                ax.plot([i, i], losses, "o", color=color)
                print(f"{lesson}: {label}: {losses}")
                continue
            for run, style in zip(runs, ["-", "--"]):
                last = draw_run(ax, run, label if style == "-" else "", color, x, style)
                print(f"{lesson}: {label}: {run}: validation {last}, {read_log(run)[0][-1]}")
        if x == "rate":
            ax.set_xticks(range(len(variants)), list(variants))
        ax.axhline(entropy, color="gray", ls="--", lw=0.8)
        ax.set(title=lesson, xlabel={"step": "steps", "elapsed": "seconds",
                                     "rate": "masked in training (dots: the end)"}[x],
               ylim=(4.2, 6.8))
        if x != "rate":
            ax.legend(fontsize=8)
    axes[0, 0].set_ylabel("masked-LM loss (nats)")
    axes[1, 0].set_ylabel("masked-LM loss (nats)")
    fig.tight_layout()
    return fig


def sts_trials(path):
    """The STS-B trials (Pearson's r x 100) of one glue.py result file, [] if there is none."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        results = json.load(f)["results"]
    return [t["pearson"] for t in results.get("STS-B", {}).get("trials", [])]


def overlap(by_budget):
    """The share of pairs of trials, one of a shorter and one of a longer budget, in which the
    longer scores higher. {1: [17, 19], 3: [18, 20]} -> pairs 17<18, 17<20, 19>18, 19<20 -> 0.75"""
    wins = pairs = 0
    for short, long in itertools.combinations(sorted(by_budget), 2):
        for a, b in itertools.product(by_budget[short], by_budget[long]):
            wins, pairs = wins + (b > a), pairs + 1
    return wins / pairs


def plot_budgets(args):
    """STS-B by pretraining budget: every trial a point (each pretraining run its colour), the
    medians joined, random weights' median as a line. A run's budget is its --time, read off its
    log (elapsed + left); a run's glue-random-init.json adds to the random weights' trials."""
    by_budget, random = {}, []
    for run in args.runs:
        last = read_log(run)[0][-1]
        minutes = round((last["elapsed"] + last["left"]) / 60)
        by_budget.setdefault(minutes, []).append(sts_trials(os.path.join(run, "glue.json")))
        random += sts_trials(os.path.join(run, "glue-random-init.json"))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    budgets = sorted(by_budget)
    medians = []
    for i, minutes in enumerate(budgets):
        for j, trials in enumerate(by_budget[minutes]):  # each pretraining run a little apart
            ax.plot([i + 1 + 0.08 * j] * len(trials), trials, "o", color=f"C{j}", ms=4)
        medians.append(statistics.median([t for trials in by_budget[minutes] for t in trials]))
        print(f"{minutes} min: {by_budget[minutes]}, median {medians[-1]:.2f}")
    ax.plot(range(1, len(budgets) + 1), medians, "k-", lw=1.5, label="median")
    ax.plot([0] * len(random), random, "o", color="gray", ms=4)
    ax.axhline(statistics.median(random), color="gray", ls="--", lw=0.8,
               label="random weights' median")
    share = overlap({m: [t for ts in by_budget[m] for t in ts] for m in budgets})
    print(f"random weights: {random}, median {statistics.median(random):.2f}; a longer budget "
          f"scores higher in {share:.0%} of the pairs")
    ax.set_xticks(range(len(budgets) + 1), ["random\nweights"] + [f"{m} min" for m in budgets])
    ax.set(ylabel="STS-B, Pearson's r x 100",
           title=f"a longer budget scores higher in {share:.0%} of the pairs of trials")
    ax.legend(fontsize=8)
    return fig


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["run", "lessons", "budgets"])
    ap.add_argument("runs", nargs="+", help="run folders (lessons: the folder that holds them)")
    ap.add_argument("--data", default="data", help="the prepared data the runs trained on")
    ap.add_argument("-o", "--out", required=True, help="the picture: .png or .svg")
    args = ap.parse_args()
    args.folder = args.runs[0]
    draw = dict(run=plot_runs, lessons=plot_lessons, budgets=plot_budgets)[args.what]
    draw(args).savefig(args.out, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    main()
