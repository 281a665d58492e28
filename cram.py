"""cram.py: pretrain the paper's final "crammed BERT" on one GPU within a wall-clock budget.

    python cram.py --time 86400                  # the paper's day, on data/ from prepare.py
    python cram.py --preset tiny --time 600      # the CPU demo (see the README)
    python cram.py --fill "the capital of france is [MASK]."    # ask the trained model
    torchrun --nproc_per_node 8 cram.py ...      # several GPUs (DDP)"""
import argparse, datetime, json, math, os, signal, time
from dataclasses import asdict, dataclass

import numpy as np, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F

from prepare import Progress, atomic, die, entry, load_tokenizer, normalize, read_prepared

# ----------------------------------------------------------------------------- the recipe
BUDGET = 86400          # seconds: one day on one GPU, compilation included
LR = 1e-3               # peak AdamW learning rate
BETAS = (0.9, 0.98)     # a shorter second-moment memory than Adam's 0.999: steadier with big lr
EPS = 1e-12             # v2's AdamW epsilon
WEIGHT_DECAY = 0.01     # on every weight but the LayerNorms', as in v2 (the position scale too)
CLIP = 0.5              # gradient-norm clipping: the paper's guard against loss spikes
LR_START = 0.25         # budget-triangle2: lr starts at 25% of the peak ...
LR_FALL = 4.0           # ... and falls as 4(1 - x), so it peaks at x = 0.75 and ends at zero
RAMP_END = 0.6          # the batch reaches --batch-size at 60% of the budget
MICRO_BATCH = 128       # sequences per forward pass (v2's default for a 24 GB GPU)
BATCH_SIZE = 8192       # sequences per step at the end of the ramp: a GPU day wants big batches
MASK_RATE = 0.25        # v2 masks 25% of the tokens (BERT: 15%): more signal per sequence
MASK_AS_MASK, MASK_AS_RANDOM = 0.8, 0.1  # of the masked: 80% [MASK], 10% a random token, 10% stay
INIT_STD = 0.02         # normal init of every linear and embedding weight
LN_EPS = 1e-12          # LayerNorm epsilon of the official model
PRESETS = {
    "crammed": dict(layers=16, width=768, heads=12, ffn=3072, micro_batch=MICRO_BATCH,
                    batch_size=BATCH_SIZE, lr=LR, alibi=0.0),  # the paper's model and batch
    # the CPU demo (data prepared with --vocab-size 2048): ten minutes on 2 cores buy a few
    # thousand steps, so they must be many, small and fast: 2 x 128, 16 sequences a step, a high lr
    "tiny": dict(layers=2, width=128, heads=2, ffn=512, micro_batch=16, batch_size=16, lr=6e-3,
                 alibi=1.0),  # ALiBi's locality, so the model need not discover it (see the README)
}
EVAL_SEED = 1234        # held-out masks are fixed, so that evaluations compare
PEAK_FLOPS = 989e12     # H100 SXM, dense bf16: MFU's denominator (A100: 312e12)
SAVE_TIMEOUT = 3600     # seconds DDP ranks wait for rank 0 to save or evaluate (NCCL's: 600)
RUN = [*PRESETS["crammed"], "time", "steps", "seed"]  # what a run is: --resume keeps its own
STOP = []               # signals received: the loop saves and exits at the next step


# ----------------------------------------------------------------------------- the model
@dataclass
class ModelConfig:
    vocab_size: int = 32768
    seq_len: int = 128
    layers: int = 16
    width: int = 768
    heads: int = 12
    ffn: int = 3072       # split into value and gate halves of ffn/2
    dropout: float = 0.0  # none in pretraining; glue.py fine-tunes with 0.1
    alibi: float = 0.0    # the CPU demo's distance penalty on attention; the paper has none


class Attention(nn.Module):
    """Multi-head self-attention with no biases; `mask` marks the keys that may be attended."""

    def __init__(self, c):
        super().__init__()
        self.heads, self.dropout = c.heads, c.dropout
        self.qkv = nn.Linear(c.width, 3 * c.width, bias=False)
        self.proj = nn.Linear(c.width, c.width, bias=False)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, mask=None):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.heads, C // self.heads)  # (B, T, 3, heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, heads, T, head_dim)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, width): heads side by side again
        return self.drop(self.proj(y))


class GatedMLP(nn.Module):
    """GELU-GLU: width -> ffn, split into value and gate, value * GELU(gate) -> width."""

    def __init__(self, c):
        super().__init__()
        self.fc = nn.Linear(c.width, c.ffn, bias=False)
        self.out = nn.Linear(c.ffn // 2, c.width, bias=False)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        value, gate = self.fc(x).chunk(2, dim=-1)  # each (B, T, ffn/2)
        return self.drop(self.out(value * F.gelu(gate)))


class Block(nn.Module):
    """Pre-normalisation: each sublayer reads a LayerNorm of the residual stream and adds to it."""

    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.width, eps=LN_EPS)
        self.attn = Attention(c)
        self.ln_2 = nn.LayerNorm(c.width, eps=LN_EPS)
        self.mlp = GatedMLP(c)

    def forward(self, x, mask=None):
        x = x + self.attn(self.ln_1(x), mask)
        x = x + self.mlp(self.ln_2(x))
        return x


def sinusoid(seq_len, width):
    """The fixed sinusoidal position table (seq_len, width) of "Attention is all you need"."""
    freq = 10000 ** (-torch.arange(0, width, 2) / width)  # (width/2,)
    angle = torch.arange(seq_len)[:, None] * freq  # (seq_len, width/2): position x frequency
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1)  # columns sin, cos, sin, ...


class Crammed(nn.Module):
    """The crammed BERT: embeddings -> LayerNorm -> pre-norm blocks -> final LayerNorm."""

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.emb = nn.Embedding(c.vocab_size, c.width)
        self.register_buffer("sinusoid", sinusoid(c.seq_len, c.width), persistent=False)
        self.pos_scale = nn.Parameter(torch.tensor(c.width ** -0.5))  # scaled sinusoidal positions
        self.emb_ln = nn.LayerNorm(c.width, eps=LN_EPS)
        self.drop = nn.Dropout(c.dropout)
        # CPU demo only: ALiBi's penalty slope x |i - j| on the scores gives a small model locality
        slopes = c.alibi * 0.5 ** torch.arange(c.heads)  # alibi, alibi/2, ... by head
        slopes[-1] = 0.0  # but the last head stays global, so that the first token can read the row
        self.register_buffer("slopes", slopes, persistent=False)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.width, eps=LN_EPS)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, INIT_STD)

    def forward(self, idx, attn_mask=None, positions=None, labels=None):
        """Hidden states (B, T, width) of ids (B, T), or given masks the masked-LM loss."""
        T = idx.size(1)
        x = self.emb(idx) + self.pos_scale * self.sinusoid[:T]  # (B, T, width)
        x = self.drop(self.emb_ln(x))
        mask = None if attn_mask is None else attn_mask[:, None, None, :]  # (B, 1, 1, T)
        if self.config.alibi:  # a float mask is added to the scores; -inf where masked out
            t = torch.arange(T, device=idx.device)
            bias = -self.slopes[:, None, None] * (t[:, None] - t).abs()  # (heads, T, T)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        for block in self.blocks:
            x = block(x, mask)
        x = self.ln_f(x)
        if positions is None:
            return x
        logits = self.decode(x, positions)  # (B, masked, vocab)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def decode(self, hidden, positions):
        """Sparse prediction: the tied decoder runs on the masked positions (B, masked) only."""
        x = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.size(-1)))
        return x @ self.emb.weight.T  # (B, masked, vocab)


def flops_per_token(c):
    """Training FLOPs per token (forward + backward = 3 x 2 x multiply-adds), the paper's count."""
    matmul = c.layers * (4 * c.width ** 2 + c.width * c.ffn + c.ffn // 2 * c.width)
    attention = 12 * c.layers * c.seq_len * c.width
    return 6 * matmul + attention + 6 * c.width * c.vocab_size * MASK_RATE


# ----------------------------------------------------------------------------- the objective
def mask_rows(rows, specials, gen):
    """Masked LM with static shapes: exactly round(0.25 x T) positions a row, never a special token
    (`specials`: their ids, the last of the vocabulary); 80% become [MASK], 10% a random token, 10%
    stay. For T=8, [SEP]=9: rows=[[5, 6, 7, 9, 1, 2, 3, 4]] -> positions=[[1, 6]], labels=[[6, 3]],
    idx=[[5, M, 7, 9, 1, 2, M, 4]]. Returns idx, positions, labels (-100: ignore)."""
    B, T = rows.shape
    special_ids, n_ordinary = torch.tensor(sorted(specials.values())), min(specials.values())
    special = torch.isin(rows, special_ids)
    noise = torch.rand(B, T, generator=gen).masked_fill(special, 2.0)  # specials sort last
    positions = noise.topk(round(MASK_RATE * T), dim=1, largest=False).indices  # (B, masked)
    labels = rows.gather(1, positions)
    r = torch.rand(positions.shape, generator=gen)
    random_ids = torch.randint(0, n_ordinary, positions.shape, generator=gen)
    new = torch.where(r < MASK_AS_MASK + MASK_AS_RANDOM, random_ids, labels)
    new = torch.where(r < MASK_AS_MASK, specials["[MASK]"], new)
    hit = torch.isin(labels, special_ids)  # only in rows with fewer ordinary tokens than masks
    idx = rows.scatter(1, positions, torch.where(hit, labels, new))
    return idx, positions, labels.masked_fill(hit, -100)


def masked(rows, specials, seed, device):
    """The model's inputs: rows (numpy) masked on the CPU as a pure function of a seed, then moved
    to the device; pinned memory lets the copy overlap the GPU's work on the last micro-batch."""
    rows = torch.from_numpy(rows.astype(np.int64))
    out = mask_rows(rows, specials, torch.Generator().manual_seed(seed & (2 ** 63 - 1)))
    if device.type == "cuda":
        out = [t.pin_memory().to(device, non_blocking=True) for t in out]
    return dict(zip(("idx", "positions", "labels"), out))


# ----------------------------------------------------------------------------- the budget
def schedule(x, peak):
    """budget-triangle2: 25% of the peak at the start, the peak at 75% of the budget, 0 at the
    end. x=0 -> 0.25 peak, x=0.5 -> 0.75 peak, x=0.75 -> peak, x=0.9 -> 0.4 peak."""
    return peak * min(LR_START + x, LR_FALL * (1 - x))


def ramp(x, batch_size, micro):
    """Micro-batches per step: the batch grows linearly to batch_size at 60% of the budget.
    batch_size=8192, micro=128: x=0 -> 1, x=0.3 -> 32, x=0.6 and after -> 64."""
    return max(1, round(batch_size / micro * min(1.0, x / RAMP_END)))


class Batches:
    """Rows in a seeded uniform order, a new permutation every epoch (v2: a sentence-length
    curriculum); (epoch, pos) is all the state, so a resume reads the same rows; ranks: a slice."""

    def __init__(self, rows, micro, seed, rank=0, world=1, epoch=0, pos=0):
        self.rows, self.micro, self.seed, self.rank, self.world = rows, micro, seed, rank, world
        self.epoch, self.pos, self.order = epoch, pos, None

    def __next__(self):
        if self.pos + self.micro * self.world > len(self.rows):
            self.epoch, self.pos = self.epoch + 1, 0
        if self.pos == 0 or self.order is None:  # the epoch's order: numpy's, 4 bytes a row, not 8
            self.order = np.arange(len(self.rows), dtype=np.uint32)
            np.random.default_rng((self.seed, self.epoch)).shuffle(self.order)
        start = self.pos + self.rank * self.micro
        self.pos += self.micro * self.world
        return self.rows[np.sort(self.order[start:start + self.micro])]  # sorted: reads go forward


@torch.no_grad()
def evaluate(model, rows, specials, micro, device):
    """Masked-LM loss and top-1 accuracy on the masked tokens of `rows`. Row i is masked with the
    seed EVAL_SEED + i alone, so its mask does not depend on the batching: evaluations compare."""
    model.eval()
    loss, right, count, progress = 0.0, 0, 0, Progress("evaluate", len(rows), "rows")
    cpu = torch.device("cpu")  # rows masked one by one here, then moved to the device at once
    per_row = [masked(row[None], specials, EVAL_SEED + i, cpu) for i, row in enumerate(rows)]
    inputs = {k: torch.cat([r[k] for r in per_row]).to(device) for k in per_row[0]}  # (rows, ...)
    for i in range(0, len(rows), micro):
        if STOP:  # Ctrl-C or SIGTERM: stop within a micro-batch, as training does within a step
            break
        idx, positions, labels = (inputs[k][i:i + micro] for k in ("idx", "positions", "labels"))
        with autocast(device):
            logits = model.decode(model(idx), positions)  # (B, masked, vocab)
        keep = labels != -100
        loss += F.cross_entropy(logits[keep].float(), labels[keep], reduction="sum").item()
        right += (logits.argmax(-1) == labels)[keep].sum().item()
        count += keep.sum().item()
        progress(i + len(labels))
    model.train()
    return loss / max(count, 1), right / max(count, 1)


# ----------------------------------------------------------------------------- training
def autocast(device):
    """bf16 on the GPU: tensor-core speed, and unlike fp16 it needs no loss scaling."""
    return torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")


def build(c, args, device, world=1):
    """(model to call, the raw module, AdamW): compiled on CUDA, wrapped in DDP under torchrun."""
    torch.manual_seed(args.seed)
    raw = Crammed(c).to(device)
    norms = {p for m in raw.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    decay = [p for p in raw.parameters() if p not in norms]  # v2: all but biases and norms
    rest = [p for p in raw.parameters() if p in norms]  # in a fixed order, for --resume
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=BETAS, eps=EPS, fused=device.type == "cuda")
    model = raw
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        if not args.no_compile:
            model = torch.compile(model)  # one graph, static shapes: the masks make them so
    if world > 1:  # DDP starts by copying rank 0's weights to every rank
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return model, raw, opt


LINE = {"step": "step {}", "tokens": "{:,} tok", "loss": "loss {:.4f}", "lr": "lr {:.2e}",  # how
        "batch": "batch {}", "tok_s": "{:,} tok/s", "mfu": "mfu {:.1%}",  # a record prints
        "elapsed": "{:,.0f}s elapsed", "left": "{:,.0f}s left", "val_loss": "val loss {:.4f}",
        "val_acc": "accuracy {:.1%}"}


class Trainer:
    """One run. A checkpoint holds `state`, the weights, the optimizer, the RNG: resume is exact."""

    def __init__(self, args, rank, world, device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        meta, self.tok, rows = read_prepared(args.data)
        self.path = os.path.join(args.out, "ckpt.pt")
        self.state = state = dict(step=0, seqs=0, elapsed=0.0, data=[0, 0])  # data: epoch, pos
        if args.resume:
            ckpt = load_checkpoint(self.path, meta, self.tok, "; start without --resume")
            run = {k: ckpt["args"][k] for k in RUN}  # the schedule depends on them
            vars(args).update(run)
            state.update({k: ckpt[k] for k in state})
        elif os.path.exists(self.path):  # a folder holds a run once it holds a checkpoint
            die(f"--out {args.out} holds a run: continue it with --resume, or use another --out")
        os.makedirs(args.out, exist_ok=True)
        self.c = ModelConfig(meta["vocab_size"], meta["seq_len"], args.layers, args.width,
                             args.heads, args.ffn, alibi=args.alibi)
        self.model, self.raw, self.opt = build(self.c, args, device, world)
        if rank == 0:  # a new run replaces the log of one that died before its first checkpoint
            self.logf = open(os.path.join(args.out, "log.jsonl"), "a" if args.resume else "w")
        n = sum(p.numel() for p in self.raw.parameters())
        budget = f"{args.steps} steps" if args.steps else f"{args.time:.0f}s"
        self.log(f"crammed BERT {self.c.layers} x {self.c.width}: {n / 1e6:.1f} M parameters, "
                 f"{flops_per_token(self.c) / 1e9:.3f} GFLOP/token | budget {budget} | batch "
                 f"ramps to {args.batch_size} in micro-batches of {args.micro_batch} x {world} "
                 f"on {device} | peak lr {args.lr}")
        if device.type == "cpu" and self.c == ModelConfig(meta["vocab_size"]):  # a laptop, say
            self.log("a CPU trains the paper's model at ~275 tok/s (2 cores: 24 M tokens a day, "
                     "1/200 of its GPU); the README's CPU demo learns in minutes: --preset tiny")
        self.data = Batches(rows["train"], args.micro_batch, args.seed, rank, world, *state["data"])
        self.val, self.specials = rows["val"][:args.eval_rows], self.tok["special_tokens"]
        if args.resume:
            self.raw.load_state_dict(ckpt["model"])
            self.opt.load_state_dict(ckpt["optimizer"])
            torch.set_rng_state(ckpt["rng"])
            self.log(f"resumed at step {state['step']} with the run's own settings {run}")
            self.save()  # now: a folder that takes no file, or a full disk, is found before a step

    def log(self, line="", **record):
        """A line, or a record: printed as one ('step 3 | loss 4.5000 | ...'), kept in log.jsonl."""
        if self.rank == 0:
            fields = (LINE[k].format(v) for k, v in record.items() if k in LINE)
            print(line or " | ".join(fields), flush=True)
            if record:
                print(json.dumps(record), file=self.logf, flush=True)

    def train(self):
        """The loop: the clock, a step, and on their own clocks a log line, validation, a save."""
        a, s, T = self.args, self.state, self.c.seq_len
        t_start = time.time() - s["elapsed"]  # a resumed run goes on from its own elapsed time
        t_log = t_eval = t_save = time.time()
        busy, seqs_log, losses = 0.0, s["seqs"], []
        while True:
            now = torch.tensor([time.time() - t_start, len(STOP)], dtype=torch.float64)
            if self.world > 1:  # ranks' clocks differ: all take the largest, and any rank's signal
                now = now.to(self.device)
                dist.all_reduce(now, dist.ReduceOp.MAX)
            s["elapsed"], stop = now.tolist()
            x = s["step"] / a.steps if a.steps else s["elapsed"] / a.time  # the budget used
            if stop or x >= 1:
                break
            t = time.time()
            batch, loss = self.train_step(x)
            busy += time.time() - t  # the rate counts training only, no saves or validations
            losses.append(loss)
            if time.time() - t_log >= a.log_every or s["step"] == 1:
                elapsed, tok_s = time.time() - t_start, (s["seqs"] - seqs_log) * T / busy
                left = (a.steps - s["step"]) * elapsed / s["step"] if a.steps else a.time - elapsed
                self.log(step=s["step"], seqs=s["seqs"], tokens=s["seqs"] * T,
                         loss=sum(losses) / len(losses), lr=schedule(x, a.lr), batch=batch,
                         tok_s=round(tok_s), mfu=flops_per_token(self.c) * tok_s / self.world
                         / PEAK_FLOPS, elapsed=round(elapsed, 1), left=max(0.0, left))
                t_log, busy, seqs_log, losses = time.time(), 0.0, s["seqs"], []
            if a.eval_every and time.time() - t_eval >= a.eval_every and self.rank == 0:
                self.validate()
                t_eval = time.time()
            if time.time() - t_save >= a.save_every:
                self.save()
                t_save = time.time()
        self.save()
        if self.world > 1:  # no rank leaves before rank 0's checkpoint is on the disk
            dist.barrier()
            dist.destroy_process_group()
        if not STOP and self.rank == 0:
            self.validate()
        if STOP:  # before the validation, or during it
            self.log(f"stopped by signal {STOP[0]} at step {s['step']}: {self.path} saved; "
                     f"continue with --resume")
            raise SystemExit(128 + STOP[0])
        self.log(f"done in {s['elapsed']:.0f}s: {s['step']} steps, {s['seqs'] * T:,} tokens; "
                 f"{self.path}")
        return self.raw

    def train_step(self, x):
        """Accumulate micro-batches up to the ramp's batch, clip, step: -> (batch, loss)."""
        a, s = self.args, self.state
        for g in self.opt.param_groups:
            g["lr"] = schedule(x, a.lr)
        accum = ramp(x, a.batch_size, a.micro_batch * self.world)
        loss_sum = torch.zeros((), device=self.device)
        for i in range(accum):  # on a GPU, the CPU masks micro-batch i + 1 while the GPU works on i
            seed = hash((a.seed, self.rank, s["step"], i))  # masks are a pure function: resumable
            inputs = masked(next(self.data), self.specials, seed, self.device)
            if self.world > 1:  # DDP: all-reduce the gradients once, after the last micro-batch
                self.model.require_backward_grad_sync = i == accum - 1
            with autocast(self.device):
                loss = self.model(**inputs) / accum  # we want the MEAN over micro-batches
            loss.backward()
            loss_sum += loss.detach()
        norm = nn.utils.clip_grad_norm_(self.raw.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss, norm = torch.stack([loss_sum, norm]).tolist()  # the step's one CPU-GPU sync point
        if not math.isfinite(norm):  # the paper's clipping keeps this away; never saved
            die(f"loss not finite at step {s['step']}: rerun with a lower --lr in a new --out")
        batch = accum * a.micro_batch * self.world
        s["step"], s["seqs"] = s["step"] + 1, s["seqs"] + batch
        return batch, loss

    def validate(self):
        """Held-out masked-LM loss and accuracy on val.bin, logged."""
        s = self.state
        loss, acc = evaluate(self.raw, self.val, self.specials, self.args.micro_batch, self.device)
        if not STOP:  # a validation a signal cut short is not logged
            self.log(step=s["step"], seqs=s["seqs"], tokens=s["seqs"] * self.c.seq_len,
                     elapsed=round(s["elapsed"], 1), val_loss=loss, val_acc=acc)

    def save(self):
        """Rank 0 writes the checkpoint atomically: a crash or a full disk leaves the last one."""
        self.state["data"] = [self.data.epoch, self.data.pos]
        if self.rank != 0:
            return
        try:
            with atomic(self.path) as f:
                torch.save({"format": "cram-ckpt-1", "model_config": asdict(self.c),
                            "tokenizer": self.tok, "model": self.raw.state_dict(),
                            "optimizer": self.opt.state_dict(), "args": vars(self.args),
                            "rng": torch.get_rng_state(), **self.state}, f)
        except (OSError, RuntimeError) as e:  # torch.save says RuntimeError for a full disk
            die(f"{self.path}: cannot save the checkpoint ({str(e)[:70]}); the last one is intact")


# ----------------------------------------------------------------------------- asking the model
def encode_masked(text, enc):
    """Ids of a text with [MASK]s, normalised as in prepare.py; like a word in the corpus, a [MASK]
    takes the space before it: 'The Cat [MASK] on it' -> ids('the cat') + [MASK] + ids(' on it')."""
    text = normalize(text).replace(" [mask]", "[mask]").replace("[mask]", "[MASK]")
    return enc.encode(text, allowed_special={"[MASK]"}, disallowed_special=())


@torch.no_grad()
def fill(args, device):
    """--fill: the checkpoint's top 5 tokens, with probabilities, for each [MASK] of each text."""
    ckpt, answers = load_checkpoint(args.ckpt), []
    model, enc = load_model(ckpt).to(device).eval(), load_tokenizer(ckpt["tokenizer"])
    specials, T = ckpt["tokenizer"]["special_tokens"], model.config.seq_len
    for text in args.fill:
        ids = torch.tensor([encode_masked(text, enc)[:T]], device=device)  # (1, T)
        positions = (ids == specials["[MASK]"]).nonzero()[:, 1][None]  # (1, masks)
        if not positions.numel():
            die(f"--fill {text!r}: no [MASK] in its first {T} tokens")
        logits = model.decode(model(ids), positions)[0]  # (masks, vocab)
        logits[:, min(specials.values()):] = -float("inf")  # specials come last: never a guess
        print(text)
        for k, p in enumerate(logits.softmax(-1)):
            top = [(enc.decode([int(t)]).strip(), float(v)) for v, t in zip(*p.topk(5))]
            answers.append(top)
            print(f"  [MASK] {k + 1}: " + ", ".join(f"{w!r} {v:.3f}" for w, v in top), flush=True)
    return answers


# ----------------------------------------------------------------------------- plumbing
def load_checkpoint(path, meta=None, tok=None, hint=""):
    """A cram checkpoint; given prepared data, it must share the data's tokenizer and rows."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        die(f"{path}: no checkpoint here{hint}")
    except PermissionError:
        raise  # the file is there, but this user cannot read it: entry says so in one line
    except Exception as e:  # torch raises many kinds for a damaged file
        die(f"{path}: corrupt or unreadable checkpoint ({type(e).__name__}: {str(e)[:120]})")
    if not isinstance(ckpt, dict) or ckpt.get("format") != "cram-ckpt-1":
        die(f"{path}: not a cram checkpoint")
    if meta and (ckpt["tokenizer"]["ranks"] != tok["ranks"]
                 or ckpt["model_config"]["seq_len"] != meta["seq_len"]):
        die(f"{path}: trained with another tokenizer or row length than this data; prepare the "
            f"data with --tokenizer")
    return ckpt


def load_model(ckpt, **overrides):
    """The Crammed model of a checkpoint, with config fields overridden (e.g. dropout)."""
    model = Crammed(ModelConfig(**{**ckpt["model_config"], **overrides}))
    model.load_state_dict(ckpt["model"])
    return model


def get_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    arg = ap.add_argument
    arg("--data", default="data", help="folder written by prepare.py")
    arg("--out", default="out", help="folder for ckpt.pt and log.jsonl")
    arg("--time", type=float, default=BUDGET, help="budget in seconds, compilation included")
    arg("--steps", type=int, help="budget in optimizer steps instead (reproducible runs)")
    arg("--preset", choices=PRESETS, default="crammed", help="the paper's, or tiny: the CPU demo")
    for k in ("layers", "width", "heads", "ffn"):
        arg(f"--{k}", type=int, help=f"model {k} (overrides the preset)")
    arg("--micro-batch", type=int, help=f"sequences per forward pass ({MICRO_BATCH})")
    arg("--batch-size", type=int, help=f"sequences per step at the end of the ramp ({BATCH_SIZE})")
    arg("--lr", type=float, help=f"peak learning rate ({LR})")
    arg("--seed", type=int, default=0, help="seeds the initialisation, data order and masks")
    arg("--device", help="cuda, cpu, cuda:1, ... (default: cuda when available)")
    arg("--no-compile", action="store_true", help="skip torch.compile (on by default on CUDA)")
    arg("--log-every", type=float, default=10, help="seconds between log lines")
    arg("--eval-every", type=float, default=0, help="seconds between held-out evaluations")
    arg("--eval-rows", type=int, default=2048, help="held-out rows for the loss and accuracy")
    arg("--save-every", type=float, default=1800, help="seconds between checkpoints")
    arg("--resume", action="store_true", help="continue OUT/ckpt.pt exactly where it stopped")
    arg("--fill", nargs="+", metavar="TEXT", help="--ckpt's top 5 for each [MASK], no training")
    arg("--ckpt", help="checkpoint for --fill (default: OUT/ckpt.pt)")
    args = ap.parse_args(argv)  # then the preset fills in what no flag gave
    vars(args).update({k: v for k, v in PRESETS[args.preset].items() if vars(args).get(k) is None})
    if args.width % args.heads or args.ffn % 2 or args.batch_size < args.micro_batch:
        ap.error("--width must divide by --heads, --ffn be even, --batch-size >= --micro-batch")
    args.ckpt = args.ckpt or os.path.join(args.out, "ckpt.pt")
    return args


def setup(args):
    """(rank, world, device): under torchrun each process takes its own GPU and joins the group."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if "RANK" not in os.environ:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=SAVE_TIMEOUT))
    return dist.get_rank(), dist.get_world_size(), device


def stop(signum, frame):
    """Ctrl-C or SIGTERM: said at once, for a step of the paper's model on a CPU takes minutes."""
    print(f"signal {signum}: the run stops after this step and saves", flush=True)
    STOP.append(signum)


@entry
def main(argv=None):
    args = get_args(argv)
    rank, world, device = setup(args)
    if args.fill:
        return fill(args, device)
    STOP.clear()  # Ctrl-C and SIGTERM save and stop after this step; then the caller's handlers
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return Trainer(args, rank, world, device).train()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    main()
