"""cram.py: pretrain the paper's final "crammed BERT" on one GPU within a wall-clock budget.

    python cram.py --time 86400                  # the paper's day, on data/ from prepare.py
    python cram.py --preset tiny --time 600      # the CPU demo (see the README)
    python cram.py --fill "the capital of france is [MASK]."    # ask the trained model
    torchrun --nproc_per_node 8 cram.py ...      # several GPUs (DDP)"""
import argparse, datetime, json, math, os, signal, time
from dataclasses import asdict, dataclass

import numpy as np, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F

from prepare import SEQ_LEN, VOCAB_SIZE, Progress, above_zero, atomic, damaged, die, entry
from prepare import load_tokenizer, normalize, read_prepared

# ----------------------------------------------------------------------------- the recipe
BUDGET = 86400          # seconds: one day on one GPU, compilation included
LR = 1e-3               # peak AdamW learning rate: v2's, high for BERT; pre-norm keeps it stable
BETAS = (0.9, 0.98)     # a shorter second-moment memory than Adam's 0.999: steadier with big lr
EPS = 1e-12             # v2's AdamW epsilon
WEIGHT_DECAY = 0.01     # on every weight but the LayerNorms', as in v2 (the position scale too)
CLIP = 0.5              # gradient-norm clipping: the paper's guard against loss spikes
LR_START = 0.25         # budget-triangle2: lr starts at 25% of the peak ...
LR_FALL = 4.0           # ... and falls as 4(1 - x), so it peaks at x = 0.75 and ends at zero
RAMP_END = 0.6          # the batch reaches --batch-size at 60% of the budget
RAMP_FIRST = 1 / 8      # the default micro-batch: at most this share of the batch (v2's: 1/64)
MICRO_BATCH = 128       # sequences per forward pass: v2's, for a GPU of 24 GB
BATCH_SIZE = 8192       # sequences per step at the end of the ramp: a GPU day wants big batches
MASK_RATE = 0.25        # v2 masks 25% of the tokens (BERT: 15%): more signal per sequence
MASK_AS_MASK = 0.8      # of the masked positions, 80% read [MASK] ...
MASK_AS_RANDOM = 0.1    # ... 10% a random token, and the other 10% keep their own token
INIT_STD = 0.02         # normal init of every linear and embedding weight, as in v2
LN_EPS = 1e-12          # LayerNorm epsilon of the official model
PRESETS = {"crammed": dict(layers=16, width=768, heads=12, ffn=3072, micro_batch=MICRO_BATCH,
                           batch_size=BATCH_SIZE, lr=LR, alibi=0.0),  # BERT-base's width
           # the CPU demo: many small, fast steps, and ALiBi's locality for free (the README)
           "tiny": dict(layers=2, width=128, heads=2, ffn=512, micro_batch=16, batch_size=16,
                        lr=6e-3, alibi=1.0)}
GPU_MICRO_BATCH = {40: 512, 20: 256, 0: MICRO_BATCH}  # GB of GPU memory -> the micro-batch
PEAK = 989e12           # MFU's denominator on every GPU: the H100's (and H200's) dense bf16 FLOP/s
EVAL_SEED = 1234        # held-out masks are fixed, so that evaluations compare
SAVE_TIMEOUT = 3600     # seconds DDP ranks wait for rank 0 to save or evaluate (NCCL's: 600)
RUN_SETTINGS = [*PRESETS["crammed"], "time", "steps", "seed"]  # a run's own: --resume keeps them
RESUME_MAY_CHANGE = ["micro_batch", "lr"]  # after out of memory, or a gradient not finite


# ----------------------------------------------------------------------------- the model
@dataclass
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    seq_len: int = SEQ_LEN
    layers: int = PRESETS["crammed"]["layers"]
    width: int = PRESETS["crammed"]["width"]
    heads: int = PRESETS["crammed"]["heads"]
    ffn: int = PRESETS["crammed"]["ffn"]
    dropout: float = 0.0  # none in pretraining; glue.py fine-tunes with 0.1
    alibi: float = 0.0    # the CPU demo's distance penalty on attention; the paper has none


class Attention(nn.Module):
    """Multi-head self-attention with no biases. `visible`: None, the keys that are not padding
    (B, 1, 1, T), or ALiBi's bias on the scores, (heads, T, T) or (B, heads, T, T) with padding."""

    def __init__(self, c):
        super().__init__()
        self.heads, self.dropout = c.heads, c.dropout
        self.qkv = nn.Linear(c.width, 3 * c.width, bias=False)
        self.proj = nn.Linear(c.width, c.width, bias=False)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, visible=None):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.heads, C // self.heads)  # (B, T, 3, nh, hs)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, width)
        return self.drop(self.proj(y))


class GatedMLP(nn.Module):
    """GELU-GLU: width -> ffn, split into value and gate, value * GELU(gate) -> width."""

    def __init__(self, c):
        super().__init__()
        self.fc = nn.Linear(c.width, c.ffn, bias=False)
        self.out = nn.Linear(c.ffn // 2, c.width, bias=False)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        # two products, not one split after: the backward never joins their (B, T, ffn/2) grads
        w_value, w_gate = self.fc.weight.chunk(2)  # each (ffn/2, width)
        value, gate = F.linear(x, w_value), F.linear(x, w_gate)  # each (B, T, ffn/2)
        return self.drop(self.out(value * F.gelu(gate)))


class Block(nn.Module):
    """Pre-normalisation: each sublayer reads a LayerNorm of the residual stream and adds to it."""

    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.width, eps=LN_EPS)
        self.attn = Attention(c)
        self.ln_2 = nn.LayerNorm(c.width, eps=LN_EPS)
        self.mlp = GatedMLP(c)

    def forward(self, x, visible=None):
        x = x + self.attn(self.ln_1(x), visible)
        x = x + self.mlp(self.ln_2(x))
        return x


def sinusoid(seq_len, width):
    """The fixed sinusoidal position table (seq_len, width) of "Attention is all you need"."""
    freq = 10000 ** (-torch.arange(0, width, 2) / width)  # (width/2,)
    angle = torch.arange(seq_len)[:, None] * freq  # (seq_len, width/2)
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1)  # columns sin, cos, sin, ...


class Crammed(nn.Module):
    """The crammed BERT: embeddings -> LayerNorm -> pre-norm blocks -> final LayerNorm."""

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.emb = nn.Embedding(c.vocab_size, c.width)
        self.register_buffer("sinusoid", sinusoid(c.seq_len, c.width), persistent=False)
        # v2's scaled sinusoidal positions: a learned scale sets how loud they are beside the tokens
        self.pos_scale = nn.Parameter(torch.tensor(c.width ** -0.5))
        self.emb_ln = nn.LayerNorm(c.width, eps=LN_EPS)
        self.drop = nn.Dropout(c.dropout)
        # the CPU demo's ALiBi: a penalty of slope x |i - j| on the scores, alibi/2**h for head h
        slopes = c.alibi * 0.5 ** torch.arange(c.heads)
        slopes[-1] = 0.0  # but the last head stays global, so that every token sees the whole row
        self.register_buffer("slopes", slopes, persistent=False)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.width, eps=LN_EPS)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, INIT_STD)

    def forward(self, idx, not_pad=None, positions=None, labels=None):
        """Hidden states (B, T, width) of ids (B, T), or with the masked positions and their labels
        the masked-LM loss. not_pad (B, T): False at padding (fine-tuning); pretraining has none."""
        T = idx.size(1)
        x = self.emb(idx) + self.pos_scale * self.sinusoid[:T]  # (B, T, width)
        x = self.drop(self.emb_ln(x))
        visible = None if not_pad is None else not_pad[:, None, None, :]  # (B, 1, 1, T)
        if self.config.alibi:  # a float bias instead of the bool mask: -inf hides padding
            t = torch.arange(T, device=idx.device)
            bias = -self.slopes[:, None, None] * (t[:, None] - t).abs()  # (heads, T, T)
            visible = bias if visible is None else bias.masked_fill(~visible, float("-inf"))
        for block in self.blocks:
            x = block(x, visible)
        x = self.ln_f(x)
        if positions is None:
            return x
        logits = self.decode(x, positions)  # (B, masked, vocab)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def decode(self, hidden, positions):
        """Sparse prediction: the tied decoder runs on the masked positions (B, masked) only."""
        x = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.size(-1)))  # (B, masked, C)
        return x @ self.emb.weight.T  # (B, masked, vocab)


def flops_per_token(c):
    """Training FLOPs per token, PaLM's count (Chowdhery et al. 2022, app. B; nanoGPT's MFU too): 6
    a weight (forward and backward), 12 x layers x T x width for attention, the decoder at 25%."""
    matmul = c.layers * (4 * c.width ** 2 + c.width * c.ffn + c.ffn // 2 * c.width)
    attention = 12 * c.layers * c.seq_len * c.width
    return 6 * matmul + attention + 6 * c.width * c.vocab_size * MASK_RATE


# ----------------------------------------------------------------------------- the objective
def mask_rows(rows, specials, gen):
    """Masked LM with static shapes: exactly round(0.25 x T) positions a row, never a special token
    (`specials`: the last ids), 80% of them then read [MASK], 10% a random ordinary token, 10%
    their own. One possible draw, T=8, [SEP]=12, [MASK]=M: rows=[[5, 6, 7, 12, 1, 2, 3, 4]] ->
    positions=[[1, 6]], labels=[[6, 3]], idx=[[5, M, 7, 12, 1, 2, M, 4]]. Each [SEP] follows a
    document, so a row has T/2 ordinary tokens or more. No row holds [CLS] (v2 neither): every
    slot holds text, and fine-tuning teaches the first position what GLUE's head reads there."""
    B, T = rows.shape
    n_ordinary = min(specials.values())  # ordinary tokens are the ids below the specials
    # the positions: the smallest of uniform noise, in which the specials' 2.0 sorts last
    noise = torch.rand(B, T, generator=gen).masked_fill(rows >= n_ordinary, 2.0)
    positions = noise.topk(round(MASK_RATE * T), dim=1, largest=False).indices  # (B, masked)
    labels = rows.gather(1, positions)  # (B, masked)
    roll = torch.rand(positions.shape, generator=gen)
    random_ids = torch.randint(0, n_ordinary, positions.shape, generator=gen)
    as_mask = roll < MASK_AS_MASK
    as_random = ~as_mask & (roll < MASK_AS_MASK + MASK_AS_RANDOM)
    shown = torch.where(as_mask, specials["[MASK]"], torch.where(as_random, random_ids, labels))
    return rows.scatter(1, positions, shown), positions, labels


def masked(rows, specials, seed, device):
    """The model's inputs on the device: rows (numpy) masked on the CPU, a pure function of seed."""
    rows = torch.from_numpy(rows.astype(np.int64))
    out = mask_rows(rows, specials, torch.Generator().manual_seed(seed & (2 ** 63 - 1)))
    return dict(zip(("idx", "positions", "labels"), (to_device(t, device) for t in out)))


def to_device(t, device):
    """A CPU tensor to the device; pinned, the copy lets the CPU go on with the next batch."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


# ----------------------------------------------------------------------------- the budget
def schedule(used, peak):
    """budget-triangle2, on `used`, the fraction of the budget used: 25% of the peak at the start,
    the peak at 75%, 0 at the end. 0 -> 0.25 peak, 0.5 -> 0.75, 0.75 -> peak, 0.9 -> 0.4 peak."""
    return peak * min(LR_START + used, LR_FALL * (1 - used))


def ramp(used, batch_size, micro):
    """Micro-batches per step: the first step is one micro-batch, and the batch grows linearly to
    batch_size at 60% of the budget. batch_size=8192, micro=128: 0 -> 1, 0.3 -> 32, 0.6 and after
    -> 64; micro=512: 0 -> 1 (512 sequences), 0.3 -> 8, 0.6 -> 16."""
    return max(1, round(batch_size / micro * min(1.0, used / RAMP_END)))


def budget_used(step, elapsed, args):
    """The fraction of the budget used: of --steps, or of --time's seconds."""
    return step / args.steps if args.steps else elapsed / args.time


class Batches:
    """Rows in a seeded uniform order, a new permutation every epoch (v2: a sentence-length
    curriculum); (epoch, pos) is all the state. Rank r reads micro-batch r of every `world`."""

    def __init__(self, rows, micro, seed, rank=0, world=1):
        self.rows, self.micro, self.seed, self.rank, self.world = rows, micro, seed, rank, world
        self.epoch, self.pos, self.order = 0, 0, None

    def __next__(self):
        if self.pos + self.micro * self.world > len(self.rows):
            self.epoch, self.pos = self.epoch + 1, 0
        if self.pos == 0 or self.order is None:  # numpy's permutation, 4 bytes a row, not 8
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
    per_row = [masked(r[None], specials, EVAL_SEED + i, torch.device("cpu"))
               for i, r in enumerate(rows)]
    inputs = {k: torch.cat([r[k] for r in per_row]).to(device) for k in per_row[0]}
    loss_sum, right = 0.0, 0
    progress = Progress("evaluate", len(rows), "rows")
    for i in range(0, len(rows), micro):
        idx, positions, labels = (inputs[k][i:i + micro] for k in ("idx", "positions", "labels"))
        with autocast(device):
            logits = model.decode(model(idx), positions)  # (micro, masked, vocab)
        loss_sum += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                    reduction="sum").item()
        right += (logits.argmax(-1) == labels).sum().item()
        progress(i + len(labels))
    model.train()
    return loss_sum / inputs["labels"].numel(), right / inputs["labels"].numel()


def validate(model, val, specials, micro, device, logf, state):
    """Rank 0 (logf open) logs the held-out loss and accuracy on `val` (--eval-rows 0: none)."""
    if logf and len(val):
        loss, acc = evaluate(model, val, specials, micro, device)
        log(logf, step=state["step"], seqs=state["seqs"], tokens=state["seqs"] * val.shape[1],
            elapsed=round(state["elapsed"], 1), val_loss=loss, val_acc=acc)


# ----------------------------------------------------------------------------- training
def autocast(device):
    """bf16 on the GPU: tensor-core speed, and unlike fp16 it needs no loss scaling."""
    return torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")


def build(c, args, device, world=1):
    """(model to call, the raw module, AdamW): compiled on CUDA, wrapped in DDP under torchrun."""
    torch.manual_seed(args.seed)
    raw = Crammed(c).to(device)
    norms = {p for m in raw.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    decay = [p for p in raw.parameters() if p not in norms]
    rest = [p for p in raw.parameters() if p in norms]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0}]
    # fused on a GPU: a few kernels for all the weights (the CPU keeps torch's plain loop)
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=BETAS, eps=EPS, fused=device.type == "cuda")
    model = raw
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        if not args.no_compile:
            model = torch.compile(model)  # one graph: the fixed count of masks keeps shapes static
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return model, raw, opt


def train_step(model, opt, micro_batches, accum, lr):
    """One optimizer step: the mean gradient of `accum` micro-batches, clipped -> (loss, gradient
    norm). `micro_batches` masks each on the CPU while the GPU runs the one before. A gradient
    that is not finite leaves the weights as they were."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss_sum = 0.0
    for i, inputs in enumerate(micro_batches):
        if isinstance(model, nn.parallel.DistributedDataParallel):  # all-reduce at the last only
            model.require_backward_grad_sync = i == accum - 1
        with autocast(inputs["idx"].device):
            loss = model(**inputs) / accum  # we want the MEAN over micro-batches, not the SUM
        loss.backward()
        loss_sum += loss.detach()
    norm = nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    loss, norm = torch.stack([loss_sum, norm]).tolist()  # the step waits for the GPU here
    if math.isfinite(norm):
        opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, norm


def train(args, rank, world, device):
    """The run, in nanoGPT's order: build it (or take back a resumed one), then loop: read the
    clock, stop when the budget is spent, validate and save when due, set the lr and the batch,
    run one optimizer step, log it. -> the trained model."""
    meta, tok, rows = read_prepared(args.data)
    path = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(path) and not args.resume:
        die(f"--out {args.out} holds a run: continue it with --resume, or use another --out")
    os.makedirs(args.out, exist_ok=True)
    logf = None  # rank 0's log.jsonl: a new run writes its own, a resumed one appends to it
    if rank == 0:
        logf = open(os.path.join(args.out, "log.jsonl"), "a" if args.resume else "w")
    c = ModelConfig(meta["vocab_size"], meta["seq_len"], args.layers, args.width, args.heads,
                    args.ffn, alibi=args.alibi)
    model, raw, opt = build(c, args, device, world)
    data = Batches(rows["train"], args.micro_batch, args.seed, rank, world)
    val, specials = rows["val"][:args.eval_rows], tok["special_tokens"]
    # the checkpoint holds `state`, the weights and AdamW's moments
    state = dict(format="cram-ckpt-1", model_config=asdict(c), tokenizer=tok, args=vars(args),
                 step=0, seqs=0, elapsed=0.0, data=[0, 0])
    if args.resume:  # on where it was saved: the same weights, moments, rows and masks
        ckpt = load_checkpoint(path, meta, tok)
        state.update({k: ckpt[k] for k in ("step", "seqs", "elapsed", "data")})
        data.epoch, data.pos = ckpt["data"]
        raw.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
    # saved at once: a disk that takes no checkpoint shows now, and every fault can say --resume
    saved = save(path, state, raw, opt, rank)  # the step on the disk, for a fault's line
    n = sum(p.numel() for p in raw.parameters())
    budget = f"{args.steps} steps" if args.steps else f"{args.time:.0f}s"
    last_batch = ramp(1.0, args.batch_size, args.micro_batch * world) * args.micro_batch * world
    log(logf, f"crammed BERT {args.layers} x {args.width}: {n / 1e6:.1f} M parameters, "
              f"{flops_per_token(c) / 1e9:.3f} GFLOP/token | budget {budget} | peak lr {args.lr} "
              f"| micro-batches of {args.micro_batch} x {world}, the batch ramps from "
              f"{args.micro_batch * world} to {last_batch} on {device}")
    if device.type == "cpu" and c == ModelConfig(c.vocab_size, c.seq_len):
        log(logf, "the paper's model on a CPU: a step takes minutes; the CPU demo learns in "
                  "minutes: --preset tiny (the README)")

    signals = []  # Ctrl-C and SIGTERM received: the run saves and stops at the end of a step

    def on_signal(signum, frame):  # said at once: a CPU step of the paper's model is slow
        print(f"signal {signum}: the run stops at the end of a step and saves", flush=True)
        signals.append(signum)
    caller = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    start = time.monotonic() - state["elapsed"]  # a resumed run goes on from its own time
    next_log = state["elapsed"]
    next_save = state["elapsed"] + args.save_every
    losses, seconds, seqs = [], 0.0, 0  # of the steps since the last log line
    compiling = device.type == "cuda" and not args.no_compile  # the first step compiles
    try:
        while True:
            # the clock and the signals, each the largest of the ranks': ranks that disagreed on
            # the budget used would choose other batches and hang DDP
            clock = torch.tensor([time.monotonic() - start, len(signals)], dtype=torch.float64)
            if world > 1:
                clock = clock.to(device)
                dist.all_reduce(clock, dist.ReduceOp.MAX)
            now, stopped = clock.tolist()
            state["elapsed"] = now
            used = budget_used(state["step"], now, args)
            if stopped or used >= 1:
                break
            if state["step"] and now >= next_save:  # a checkpoint, and in the log its held-out loss
                validate(raw, val, specials, args.micro_batch, device, logf, state)
                saved = save(path, state, raw, opt, rank)
                next_save = now + args.save_every
            lr = schedule(used, args.lr)
            accum = ramp(used, args.batch_size, args.micro_batch * world)
            batch = accum * args.micro_batch * world
            seeds = (hash((args.seed, rank, state["step"], i)) for i in range(accum))  # resumable
            micro_batches = (masked(next(data), specials, seed, device) for seed in seeds)
            t = time.monotonic()
            loss, norm = train_step(model, opt, micro_batches, accum, lr)
            seconds += time.monotonic() - t  # the rate's own timer: no saves, no validations
            state["data"] = [data.epoch, data.pos]
            if not math.isfinite(norm):  # the weights have not seen it: save them, skip its rows
                saved = save(path, state, raw, opt, rank)
                if world > 1:  # no rank leaves before rank 0's checkpoint is on the disk
                    dist.barrier()
                die(f"gradient not finite at step {state['step'] + 1}; {path} holds step {saved}: "
                    f"continue: the same command --resume --lr {args.lr / 2:g}")
            state["step"] += 1
            state["seqs"] += batch
            losses.append(loss)
            seqs += batch
            if now >= next_log:  # the steps since the last line: their mean loss, their rate
                record = dict(step=state["step"], seqs=state["seqs"],
                              tokens=state["seqs"] * c.seq_len, loss=sum(losses) / len(losses),
                              lr=lr, batch=batch)
                if compiling:  # the first step's time is mostly compiling: no rate from it
                    record["compiled"] = round(seconds, 1)
                else:
                    record["tok_s"] = round(seqs * c.seq_len / seconds)
                    record["mfu"] = flops_per_token(c) * seqs * c.seq_len / seconds / world / PEAK
                elapsed = time.monotonic() - start
                left = args.time - elapsed
                if args.steps:
                    left = (args.steps / state["step"] - 1) * elapsed
                log(logf, **record, elapsed=round(elapsed, 1), left=max(0.0, left))
                next_log = now + args.log_every
                losses, seconds, seqs, compiling = [], 0.0, 0, False
        saved = save(path, state, raw, opt, rank)
    except torch.cuda.OutOfMemoryError:  # the step may have half-run: nothing saved now
        die(f"out of memory at step {state['step'] + 1}; {path} holds step {saved}: continue: "
            f"the same command --resume --micro-batch {max(1, args.micro_batch // 2)}")
    finally:
        for s, handler in caller.items():
            signal.signal(s, handler)
    if world > 1:  # no rank leaves before rank 0's checkpoint is on the disk
        dist.barrier()
        dist.destroy_process_group()
    if signals:
        log(logf, f"stopped by signal {signals[0]} at step {state['step']}: {path} saved; "
                  f"continue with --resume")
        raise SystemExit(128 + signals[0])
    validate(raw, val, specials, args.micro_batch, device, logf, state)
    log(logf, f"done in {state['elapsed']:.0f}s: {state['step']} steps, "
              f"{state['seqs'] * c.seq_len:,} tokens; {path}")
    return raw


# ----------------------------------------------------------------------------- asking the model
def encode_masked(text, enc):
    """Ids of a text with [MASK]s, normalised as in prepare.py; like a word in the corpus, a [MASK]
    takes the space before it: 'The Cat [MASK] on it' -> ids('the cat') + [MASK] + ids(' on it')."""
    text = normalize(text).replace(" [mask]", "[mask]").replace("[mask]", "[MASK]")
    return enc.encode(text, allowed_special={"[MASK]"}, disallowed_special=())


@torch.no_grad()
def fill(args, device):
    """--fill: the checkpoint's top 5 tokens, with probabilities, for each [MASK] of each text."""
    ckpt, answers = load_checkpoint(os.path.join(args.out, "ckpt.pt")), []
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
def save(path, state, model, opt, rank):
    """Rank 0 writes the checkpoint atomically: a crash or a full disk leaves the last one whole.
    -> the step on the disk, which every rank keeps for a fault's line."""
    if rank == 0:
        ckpt = {**state, "model": model.state_dict(), "optimizer": opt.state_dict()}
        try:
            with atomic(path) as f:
                torch.save(ckpt, f)
        except (OSError, RuntimeError) as e:  # torch.save says RuntimeError for a full disk
            die(f"{path}: cannot save ({str(e)[:60]}); the checkpoint on the disk, if any, is intact")
    return state["step"]


def log(logf, line="", **record):
    """Rank 0 (logf: its log.jsonl, None on the others) prints a line, or a record as 'step 3 |
    seqs 48 | tokens 6,144 | loss 6.12346 | ...' that log.jsonl keeps."""
    if logf:
        fields = [f"{k} {v:,.6g}" if isinstance(v, float) else f"{k} {v:,}"
                  for k, v in record.items()]
        print(line or " | ".join(fields), flush=True)
        if record:
            print(json.dumps(record), file=logf, flush=True)


def load_checkpoint(path, meta=None, tok=None):
    """A cram checkpoint (mapped, not read); given prepared data, it must share its tokenizer."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except OSError as e:
        if e.filename:  # not there, or not readable: entry says which file, in one line
            raise
        damaged(path, e)  # a file cut short: mapped, it fails with an OSError naming no file
    except Exception as e:  # torch raises many kinds for a damaged file
        damaged(path, e)
    if not isinstance(ckpt, dict) or ckpt.get("format") != "cram-ckpt-1":
        die(f"{path}: not a cram checkpoint")
    if meta and (ckpt["tokenizer"]["ranks"] != tok["ranks"]
                 or ckpt["model_config"]["seq_len"] != meta["seq_len"]):
        die(f"{path}: its run's data had another tokenizer or row length than this --data")
    return ckpt


def load_model(ckpt, **overrides):
    """The Crammed model of a checkpoint, with config fields overridden (e.g. dropout)."""
    model = Crammed(ModelConfig(**{**ckpt["model_config"], **overrides}))
    model.load_state_dict(ckpt["model"])
    return model


def get_args(argv=None):
    """The run's settings in one pass: the flags given; for a run setting not given, the preset's,
    or on --resume the run's own; a resume may change RESUME_MAY_CHANGE only."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    arg, count, seconds = ap.add_argument, above_zero(int), above_zero(float, or_zero=True)

    def both(k):  # a run setting's default in each preset, for --help
        return f"crammed {PRESETS['crammed'][k]}, tiny {PRESETS['tiny'][k]}"
    arg("--data", default="data", help="folder written by prepare.py (%(default)s)")
    arg("--out", default="out", help="folder for ckpt.pt and log.jsonl (%(default)s)")
    arg("--time", type=above_zero(float), help=f"budget in seconds, compiling included ({BUDGET})")
    arg("--steps", type=count, help="budget in optimizer steps instead (reproducible)")
    arg("--seed", type=above_zero(int, or_zero=True), help="of the init, the order, the masks (0)")
    arg("--preset", choices=PRESETS, default="crammed",
        help="the paper's model and batch, or tiny: the CPU demo (%(default)s)")
    arg("--layers", type=count, help=f"blocks ({both('layers')})")
    arg("--width", type=count, help=f"hidden size ({both('width')})")
    arg("--heads", type=count, help=f"attention heads ({both('heads')})")
    arg("--ffn", type=count, help=f"the gated MLP's inner width ({both('ffn')})")
    arg("--micro-batch", type=count, help="sequences per forward pass (crammed: 128 to 512 by GPU "
        f"memory, at most 1/8 of the batch; tiny {PRESETS['tiny']['micro_batch']})")
    arg("--batch-size", type=count, help=f"sequences a step after the ramp ({both('batch_size')})")
    arg("--lr", type=above_zero(float), help=f"peak learning rate ({both('lr')})")
    arg("--device", help="cuda, cpu, cuda:1, ... (default: cuda when available)")
    arg("--no-compile", action="store_true", help="skip torch.compile (on by default on CUDA)")
    arg("--log-every", type=seconds, default=10, help="seconds between log lines (%(default)s)")
    arg("--eval-rows", type=above_zero(int, or_zero=True), default=2048,
        help="held-out rows a validation reads, on fixed masks (%(default)s)")
    arg("--save-every", type=above_zero(float), default=1800,
        help="seconds between checkpoints, each validated: what a lost GPU may cost (%(default)s)")
    arg("--resume", action="store_true", help="go on with OUT/ckpt.pt (see RESUME_MAY_CHANGE)")
    arg("--fill", nargs="+", metavar="TEXT", help="OUT/ckpt.pt's top 5 for each [MASK] of TEXT")
    args = ap.parse_args(argv)
    if args.resume:
        run = load_checkpoint(os.path.join(args.out, "ckpt.pt"))["args"]
    else:
        run = dict(PRESETS[args.preset], time=BUDGET, steps=None, seed=0)
        if args.preset == "crammed":
            run["micro_batch"] = paper_micro_batch(args.batch_size or BATCH_SIZE, args.device)
    for k in RUN_SETTINGS:
        flag, given = f"--{k.replace('_', '-')}", getattr(args, k, None)
        if given is None:
            setattr(args, k, run[k])
        elif args.resume and given != run[k] and k not in RESUME_MAY_CHANGE:
            ap.error(f"{flag} {given}: --resume keeps the run's own {run[k]}; other budgets, "
                     f"models, seeds, batches: a new --out")
    if args.width % args.heads or args.width % 2 or args.ffn % 2:
        ap.error("--width must be even and divide by --heads, and --ffn be even")
    if args.batch_size < args.micro_batch:
        ap.error("--batch-size must be at least --micro-batch")
    return args


def paper_micro_batch(batch_size, device_name):
    """The crammed preset's micro-batch by the GPU's memory (GPU_MICRO_BATCH: 512 from 40 GB, 256
    from 20, else v2's 128), at most RAMP_FIRST of the batch over all the GPUs."""
    device = pick_device(device_name)
    gb = 0  # a CPU reads GPU_MICRO_BATCH's 0 GB row: v2's 128
    if device.type == "cuda":
        gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    size = next(size for least_gb, size in GPU_MICRO_BATCH.items() if gb >= least_gb)
    world = int(os.environ.get("WORLD_SIZE", 1))
    return min(size, max(1, int(batch_size * RAMP_FIRST) // world))


def pick_device(name):
    """--device, or cuda where there is one; under torchrun each rank takes its own GPU before
    anything touches CUDA (else every rank opens a context on GPU 0). A missing one: one line."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and "LOCAL_RANK" in os.environ:
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        torch.empty(0, device=device)  # raises where the device is not there
    except (RuntimeError, AssertionError):  # AssertionError: a torch built without CUDA
        die(f"--device {name}: not a device of this machine (it has the CPU and "
            f"{torch.cuda.device_count()} CUDA GPUs)")
    return device


def setup(args):
    """(rank, world, device): under torchrun each process joins the group, on its own GPU."""
    device = pick_device(args.device)
    if "RANK" not in os.environ:
        return 0, 1, device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=SAVE_TIMEOUT))
    return dist.get_rank(), dist.get_world_size(), device


@entry
def main(argv=None):
    args = get_args(argv)
    rank, world, device = setup(args)
    if args.fill:
        return fill(args, device)
    return train(args, rank, world, device)


if __name__ == "__main__":
    main()
