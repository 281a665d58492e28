"""
cram.py: pretrain the paper's final "crammed BERT" on one GPU within a wall-clock budget.

    python cram.py --time 86400                    # the paper's day, on data/ from prepare.py
    python cram.py --preset tiny --time 1200       # a CPU demo that visibly learns
    python cram.py --bench                         # throughput (tokens/s, MFU) on random tokens
    torchrun --nproc_per_node 8 cram.py ...        # several GPUs (DDP)

Everything is scheduled on the clock (Geiping & Goldstein 2023): with x the fraction of the
budget used, the learning rate is peak x min(0.25 + x, 4(1 - x)) and the batch grows by
gradient accumulation until it reaches --batch-size at 60% of the budget.
"""
import argparse, contextlib, json, os, signal, time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from prepare import die, read_prepared

# ----------------------------------------------------------------------------- the model


@dataclass
class ModelConfig:
    vocab_size: int = 32768
    seq_len: int = 128
    layers: int = 16
    width: int = 768
    heads: int = 12
    ffn: int = 3072  # split into value and gate halves of ffn/2
    dropout: float = 0.0  # none in pretraining; glue.py fine-tunes with 0.1


class Block(nn.Module):
    """Pre-LayerNorm transformer block with a gated-GELU MLP and no biases in linear layers."""

    def __init__(self, c):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.width, eps=1e-12), nn.LayerNorm(c.width, eps=1e-12)
        self.qkv = nn.Linear(c.width, 3 * c.width, bias=False)
        self.proj = nn.Linear(c.width, c.width, bias=False)
        self.fc = nn.Linear(c.width, c.ffn, bias=False)
        self.out = nn.Linear(c.ffn // 2, c.width, bias=False)
        self.heads, self.drop = c.heads, nn.Dropout(c.dropout)

    def forward(self, x, mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.drop.p if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))
        value, gate = self.fc(self.ln2(x)).chunk(2, dim=-1)
        return x + self.drop(self.out(value * F.gelu(gate)))


class Crammed(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.emb = nn.Embedding(c.vocab_size, c.width)
        # scaled sinusoidal positions: a fixed sinusoid times one learnable scalar
        t, i = torch.arange(c.seq_len)[:, None], torch.arange(0, c.width, 2)
        pos = torch.zeros(c.seq_len, c.width)
        pos[:, 0::2], pos[:, 1::2] = torch.sin(t / 10000 ** (i / c.width)), torch.cos(t / 10000 ** (i / c.width))
        self.register_buffer("pos", pos, persistent=False)
        self.pos_scale = nn.Parameter(torch.tensor(c.width ** -0.5))
        self.emb_ln, self.ln_f = nn.LayerNorm(c.width, eps=1e-12), nn.LayerNorm(c.width, eps=1e-12)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, attn_mask=None, positions=None, labels=None):
        """Hidden states (B, T, width); with positions and labels, the masked-LM loss instead."""
        x = self.drop(self.emb_ln(self.emb(idx) + self.pos_scale * self.pos[: idx.size(1)]))
        mask = None if attn_mask is None else attn_mask[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask)
        x = self.ln_f(x)
        if positions is None:
            return x
        # sparse prediction: the tied decoder runs only on the masked positions (a quarter of them)
        x = x.gather(1, positions[..., None].expand(-1, -1, x.size(-1)))
        return F.cross_entropy((x @ self.emb.weight.T).flatten(0, 1), labels.flatten(), ignore_index=-100)


def flops_per_token(c, mask_rate=0.25):
    """Training FLOPs (forward + backward = 6 x multiply-adds) per token, as in the paper's count."""
    matmul = c.layers * (4 * c.width ** 2 + c.width * c.ffn + c.ffn // 2 * c.width)
    attention = 12 * c.layers * c.seq_len * c.width
    return 6 * matmul + attention + 6 * c.width * c.vocab_size * mask_rate


PEAK_TFLOPS = [("H100 PCIe", 756), ("H100", 989), ("H200", 989), ("GH200", 989), ("A100", 312), ("L40S", 362),
               ("A6000", 155), ("4090", 165), ("3090", 71), ("L4", 121), ("A10", 125)]  # dense bf16


# ----------------------------------------------------------------------------- the objective


def mask_rows(rows, special_ids, mask_id, n_ordinary, gen, rate=0.25):
    """Exactly round(rate x T) masked positions per row (static shapes), never a special token;
    80% become [MASK], 10% a random token, 10% stay. Returns inputs, positions, labels."""
    B, T = rows.shape
    special = torch.isin(rows, special_ids)
    pos = torch.rand(B, T, generator=gen).masked_fill(special, 2.0).topk(round(rate * T), dim=1, largest=False).indices
    orig = rows.gather(1, pos)
    r = torch.rand(pos.shape, generator=gen)
    new = torch.where(r < 0.8, mask_id, torch.where(r < 0.9, torch.randint(0, n_ordinary, pos.shape, generator=gen), orig))
    hit = torch.isin(orig, special_ids)  # only in rows with too few ordinary tokens
    inputs = rows.scatter(1, pos, torch.where(hit, orig, new))
    return inputs, pos, orig.masked_fill(hit, -100)


def schedule(x, peak):
    """budget-triangle2: 25% of peak at the start, the peak at 75% of the budget, zero at the end."""
    return peak * min(0.25 + x, 4 * (1 - x))


def ramp(x, batch_size, micro):
    """Micro-batches per optimizer step: the batch grows linearly to batch_size at 60% of the budget."""
    return max(1, round(batch_size / micro * min(1.0, x / 0.6)))


class Batches:
    """Rows of a packed .bin in a seeded random order, a new permutation every epoch.
    The position (epoch, pos) is all the state there is, so a resumed run reads the same rows."""

    def __init__(self, path, seq_len, micro, seed, rank=0, world=1, epoch=0, pos=0):
        self.rows = np.memmap(path, dtype=np.uint16, mode="r").reshape(-1, seq_len)
        if len(self.rows) < micro * world:
            die(f"{path}: {len(self.rows)} rows, fewer than one micro-batch of {micro * world}; lower --micro-batch")
        self.micro, self.seed, self.rank, self.world, self.epoch, self.pos = micro, seed, rank, world, epoch, pos
        self.perm, self.perm_epoch = None, -1

    def __next__(self):
        if self.pos + self.micro * self.world > len(self.rows):
            self.epoch, self.pos = self.epoch + 1, 0
        if self.perm_epoch != self.epoch:
            self.perm, self.perm_epoch = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.rows)), self.epoch
        start = self.pos + self.rank * self.micro
        self.pos += self.micro * self.world
        return torch.from_numpy(self.rows[np.sort(self.perm[start:start + self.micro])].astype(np.int64))


# ----------------------------------------------------------------------------- checkpoints


def load_checkpoint(path):
    if not os.path.exists(path):
        die(f"{path}: no checkpoint here")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        die(f"{path}: corrupt or unreadable checkpoint ({type(e).__name__}: {str(e)[:120]})")
    if not isinstance(ckpt, dict) or ckpt.get("format") != "cram-ckpt-1":
        die(f"{path}: not a cram checkpoint")
    return ckpt


def save_checkpoint(path, ckpt):
    """Atomic: a crash mid-write leaves the previous checkpoint intact."""
    with open(path + ".tmp", "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def pick_device(name=None):
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


# ----------------------------------------------------------------------------- training

PRESETS = {  # the paper's model and batch; a CPU-sized model with small batches: leaving the plateau takes steps
    "crammed": dict(layers=16, width=768, heads=12, ffn=3072, micro_batch=128, batch_size=8192, lr=1e-3),
    "tiny": dict(layers=4, width=256, heads=4, ffn=1024, micro_batch=32, batch_size=64, lr=2e-3),
}


def get_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data", help="folder written by prepare.py (train.bin, val.bin, meta.json)")
    ap.add_argument("--out", default="out", help="folder for ckpt.pt and log.jsonl")
    ap.add_argument("--time", type=float, default=86400, help="wall-clock budget in seconds, compilation included")
    ap.add_argument("--steps", type=int, help="budget in optimizer steps instead of seconds (reproducible runs)")
    ap.add_argument("--preset", choices=PRESETS, default="crammed", help="crammed: the paper's model; tiny: 4x256 "
                    "for CPU demos (2 cores, 32k vocab: on the unigram plateau, loss ~7.1, for its first ~2.5 min, "
                    "then it learns from context: ~6.7 at 10 min, ~6.4 at 20 min)")
    for k in ("layers", "width", "heads", "ffn"):
        ap.add_argument(f"--{k}", type=int, help=f"model {k} (overrides the preset)")
    ap.add_argument("--micro-batch", type=int, help="sequences per forward pass (crammed: 128, fits 24 GB; tiny: 32)")
    ap.add_argument("--batch-size", type=int, help="sequences per optimizer step at the end of the ramp (crammed: 8192; tiny: 64)")
    ap.add_argument("--lr", type=float, help="peak learning rate (crammed: 1e-3; tiny: 2e-3)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the initialisation, data order and masks")
    ap.add_argument("--device", help="cuda, cpu, cuda:1, ... (default: cuda when available)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (it is on by default on CUDA)")
    ap.add_argument("--log-every", type=float, default=10, help="seconds between log lines")
    ap.add_argument("--eval-every", type=float, default=0, help="seconds between held-out evaluations (0: only at the end)")
    ap.add_argument("--eval-rows", type=int, default=2048, help="val.bin rows used for the held-out MLM loss")
    ap.add_argument("--save-every", type=float, default=1800, help="seconds between checkpoints")
    ap.add_argument("--resume", action="store_true", help="continue OUT/ckpt.pt exactly where it stopped")
    ap.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: looked up for known GPUs)")
    ap.add_argument("--eval", action="store_true", help="only report OUT/ckpt.pt's MLM loss on all of DATA's rows "
                    "(e.g. held-out text prepared with --tokenizer), up to --eval-rows")
    ap.add_argument("--bench", action="store_true", help="time training steps on random tokens and exit")
    ap.add_argument("--bench-steps", type=int, default=20, help="timed steps in --bench (after 3 warm-up steps)")
    ap.add_argument("--vocab-size", type=int, default=32768, help="vocabulary for --bench (otherwise from the data)")
    args = ap.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None):
    args = get_args(argv)
    ddp = "RANK" in os.environ
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    device = pick_device(args.device)
    if ddp:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    ckpt = load_checkpoint(ckpt_path) if args.resume or args.eval else None
    if ckpt:  # the schedule depends on these, so the stored run decides them
        for k in ("time", "steps", "micro_batch", "batch_size", "lr", "seed"):
            setattr(args, k, ckpt["args"][k])

    if args.bench:
        c = ModelConfig(args.vocab_size, 128, args.layers, args.width, args.heads, args.ffn)
        tok = {"special_tokens": {s: args.vocab_size - 4 + i for i, s in enumerate(["[PAD]", "[CLS]", "[SEP]", "[MASK]"])}}
    else:
        try:
            with open(os.path.join(args.data, "meta.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            die(f"{args.data}/meta.json: no prepared data ({e}); run `python prepare.py` first")
        c = ModelConfig(meta["vocab_size"], meta["seq_len"], args.layers, args.width, args.heads, args.ffn)
        tok = read_prepared(args.data)[1]
        if ckpt and (ckpt["model_config"]["vocab_size"], ckpt["model_config"]["seq_len"]) != (c.vocab_size, c.seq_len):
            die(f"{ckpt_path}: vocab {ckpt['model_config']['vocab_size']} / seq len {ckpt['model_config']['seq_len']} "
                f"do not match {args.data} ({c.vocab_size} / {c.seq_len})")
        if ckpt and ckpt["tokenizer"]["ranks"] != tok["ranks"]:
            die(f"{ckpt_path}: trained with another tokenizer than {args.data}; prepare it with --tokenizer")
    if ckpt:
        c = ModelConfig(**ckpt["model_config"])
    if c.width % c.heads or c.ffn % 2:
        die(f"width {c.width} must divide by heads {c.heads}, and ffn {c.ffn} must be even")

    torch.manual_seed(args.seed)
    raw = Crammed(c).to(device)
    decay = [p for p in raw.parameters() if p.dim() >= 2]  # not LayerNorms, not the position scale
    rest = [p for p in raw.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-12, fused=device.type == "cuda")
    step, seqs, elapsed, skipped, epoch, pos = 0, 0, 0.0, 0, 0, 0
    if ckpt:
        raw.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        step, seqs, elapsed, skipped, (epoch, pos) = ckpt["step"], ckpt["seqs"], ckpt["elapsed"], ckpt["skipped"], ckpt["data"]
        log(f"resumed {ckpt_path} at step {step}, {elapsed:.0f}s of the budget used")
    n_params = sum(p.numel() for p in raw.parameters())
    log(f"crammed BERT: {c.layers} layers x {c.width}, {n_params / 1e6:.1f} M parameters "
        f"({(n_params - raw.emb.weight.numel()) / 1e6:.1f} M without embeddings), {flops_per_token(c) / 1e9:.3f} GFLOP/token")
    model = raw
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        if not args.no_compile:
            model = torch.compile(model)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    peak = args.peak_tflops or next((p for n, p in PEAK_TFLOPS if device.type == "cuda" and n in torch.cuda.get_device_name(device)), None)
    specials = torch.tensor(sorted(tok["special_tokens"].values()))
    mask_id, n_ordinary = tok["special_tokens"]["[MASK]"], min(tok["special_tokens"].values())  # specials come last
    gen = torch.Generator()

    def masked(rows, *key):  # masks are a pure function of (seed, rank, step, micro-batch): resumable
        gen.manual_seed(hash((args.seed, rank) + key) & (2 ** 63 - 1))
        move = (lambda t: t.pin_memory().to(device, non_blocking=True)) if device.type == "cuda" else (lambda t: t)
        return dict(zip(("idx", "positions", "labels"), map(move, mask_rows(rows, specials, mask_id, n_ordinary, gen))))

    def mfu(tok_s):
        return f"{100 * flops_per_token(c) * tok_s / world / (peak * 1e12):.1f}%" if peak else "n/a"

    if args.bench:
        times = []
        for i in range(3 + args.bench_steps):
            rows = torch.randint(0, n_ordinary, (args.micro_batch, c.seq_len))
            t0 = time.time()
            with autocast:
                loss = model(**masked(rows, i))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            times.append(time.time() - t0)
            log(f"bench step {i}: {times[-1] * 1e3:.0f} ms{' (warm-up)' if i < 3 else ''}")
        tok_s = args.micro_batch * c.seq_len * world * args.bench_steps / sum(times[3:])
        log(f"bench: {device} {torch.cuda.get_device_name(device) if device.type == 'cuda' else ''} micro-batch "
            f"{args.micro_batch} compile={model is not raw} tokens/s={tok_s:.0f}" + (f" mfu={mfu(tok_s)}" if peak else ""))
        return tok_s

    def evaluate(names=("val.bin",)):
        """Held-out MLM loss with fixed-seed masks, so that runs compare."""
        val = np.concatenate([np.memmap(os.path.join(args.data, f), dtype=np.uint16, mode="r").reshape(-1, c.seq_len)
                              for f in names])[: args.eval_rows]
        raw.eval()
        total, n = 0.0, 0
        with torch.no_grad(), autocast:
            for i in range(0, len(val), args.micro_batch):
                rows = torch.from_numpy(val[i: i + args.micro_batch].astype(np.int64))
                gen.manual_seed(1234 + i)
                inputs, positions, labels = [t.to(device) for t in mask_rows(rows, specials, mask_id, n_ordinary, gen)]
                total += raw(inputs, positions=positions, labels=labels).item() * len(rows)
                n += len(rows)
        raw.train()
        return total / n

    if args.eval:
        v = evaluate(("train.bin", "val.bin"))
        rows = sum(os.path.getsize(os.path.join(args.data, f)) for f in ("train.bin", "val.bin")) // (2 * c.seq_len)
        log(f"held-out loss of {ckpt_path} (step {step}) on {min(rows, args.eval_rows):,} rows of {args.data}: {v:.4f}")
        return v

    def save():
        if rank == 0:
            save_checkpoint(ckpt_path, {
                "format": "cram-ckpt-1", "model_config": asdict(c), "model": raw.state_dict(), "tokenizer": tok,
                "optimizer": opt.state_dict(), "args": vars(args), "step": step, "seqs": seqs, "elapsed": elapsed,
                "skipped": skipped, "data": [data.epoch, data.pos], "rng": torch.get_rng_state()})

    stop = []
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, frame: stop.append(signum))
    data = Batches(os.path.join(args.data, "train.bin"), c.seq_len, args.micro_batch, args.seed, rank, world, epoch, pos)
    logf = open(os.path.join(args.out, "log.jsonl"), "a") if rank == 0 else None

    def record(**r):
        if logf:
            logf.write(json.dumps(r) + "\n")
            logf.flush()

    log(f"budget {f'{args.steps} steps' if args.steps else f'{args.time:.0f}s'}; batch ramps to {args.batch_size} "
        f"in micro-batches of {args.micro_batch} x {world} on {device}; peak lr {args.lr}")
    t_start = time.time() - elapsed
    t_log, t_save, t_eval, seqs_log, losses, skipped_run = time.time(), time.time(), time.time(), seqs, [], 0
    while True:
        elapsed = time.time() - t_start
        x = step / args.steps if args.steps else elapsed / args.time
        flag = torch.tensor([len(stop) > 0 or x >= 1], device=device)
        if ddp:  # all ranks must leave the loop at the same step
            dist.all_reduce(flag, dist.ReduceOp.MAX)
        if flag.item():
            break
        lr = schedule(x, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        accum = ramp(x, args.batch_size, args.micro_batch * world)
        loss_sum = torch.zeros((), device=device)
        for i in range(accum):
            sync = contextlib.nullcontext() if not ddp or i == accum - 1 else model.no_sync()
            with sync, autocast:
                loss = model(**masked(next(data), step, i)) / accum
            with sync:
                loss.backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), 0.5)
        if torch.isfinite(norm):
            opt.step()
            losses.append(loss_sum.item())
            skipped_run = 0
        else:  # a non-finite loss or gradient: skip the step; give up if it persists
            skipped, skipped_run = skipped + 1, skipped_run + 1
            if skipped_run >= 20:
                die(f"loss/gradients not finite for {skipped_run} steps in a row at step {step}; lower --lr")
        opt.zero_grad(set_to_none=True)
        step, seqs = step + 1, seqs + accum * args.micro_batch * world
        now = time.time()
        if now - t_log >= args.log_every or step == 1:
            tok_s = (seqs - seqs_log) * c.seq_len / (now - t_log)
            r = dict(step=step, seqs=seqs, tokens=seqs * c.seq_len, loss=sum(losses) / max(len(losses), 1), lr=lr,
                     batch=accum * args.micro_batch * world, tok_s=round(tok_s), mfu=mfu(tok_s),
                     elapsed=round(now - t_start, 1), skipped=skipped)
            left = args.time - (now - t_start) if not args.steps else (args.steps - step) * (now - t_start) / step
            log(f"step {step} | {seqs:,} seqs {seqs * c.seq_len / 1e6:,.1f}M tok | loss {r['loss']:.4f} | lr {lr:.2e} | "
                f"batch {r['batch']} | {tok_s:,.0f} tok/s | mfu {r['mfu']} | {now - t_start:,.0f}s elapsed, {left:,.0f}s left")
            record(**r)
            t_log, seqs_log, losses = now, seqs, []
        if args.eval_every and now - t_eval >= args.eval_every and rank == 0:
            v = evaluate()
            log(f"step {step} | val loss {v:.4f}")
            record(step=step, elapsed=round(now - t_start, 1), val_loss=v)
            t_eval = time.time()
        if now - t_save >= args.save_every:
            save()
            t_save = time.time()
    elapsed = min(time.time() - t_start, args.time)
    save()
    if stop:
        log(f"stopped by signal {stop[0]} at step {step}: {ckpt_path} saved; continue with --resume")
        raise SystemExit(128 + stop[0])
    if ddp:  # replicas must hold identical weights after training
        sums = torch.stack([p.detach().double().sum() for p in raw.parameters()])
        all_sums = [torch.zeros_like(sums) for _ in range(world)]
        dist.all_gather(all_sums, sums)
        agree = all(torch.equal(all_sums[0], s) for s in all_sums)
        record(step=step, ranks_agree=agree, world=world)
        if not agree:
            die("DDP replicas diverged")
    if rank == 0:
        v = evaluate()
        log(f"done: {step} steps, {seqs:,} sequences ({seqs * c.seq_len / 1e6:,.1f}M tokens) in {elapsed:.0f}s; "
            f"val loss {v:.4f}; skipped {skipped} steps; {ckpt_path}")
        record(step=step, seqs=seqs, tokens=seqs * c.seq_len, elapsed=round(elapsed, 1), val_loss=v)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
