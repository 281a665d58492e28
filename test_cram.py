"""Tests for prepare.py, cram.py and glue.py: CPU only, no network, tiny data made here."""
import base64, gzip, http.server, io, json, math, os, random, signal, subprocess, sys, threading, time, zipfile
from dataclasses import asdict

import numpy as np
import pytest
import torch

import cram
import glue
import prepare
from cram import Crammed, ModelConfig
from conftest import *  # noqa  (TEMPORARY split)
from conftest import Handler, make_docs, prep, write_jsonl, HERE  # noqa

# ----------------------------------------------------------------------------- cram.py
TINY = ["--layers", "2", "--width", "64", "--heads", "2", "--ffn", "128", "--micro-batch", "8", "--batch-size", "16",
        "--device", "cpu", "--log-every", "0", "--eval-rows", "64"]


def records(out):
    return [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]


def test_parameter_count_and_flops():
    with torch.device("meta"):
        model = cram.Crammed(cram.ModelConfig())
    d, V, L = 768, 32768, 16
    per_layer = 2 * 2 * d + 3 * d * d + d * d + d * 3072 + 1536 * d  # 2 LayerNorms, qkv, proj, gated MLP
    assert sum(p.numel() for p in model.parameters()) == V * d + 1 + 2 * d + L * per_layer + 2 * d == 119_589_889
    assert abs(cram.flops_per_token(cram.ModelConfig()) / 1e9 - 0.62) < 0.01  # the paper's count


def test_sparse_prediction_equals_dense_and_initial_loss():
    torch.manual_seed(0)
    c = cram.ModelConfig(vocab_size=1000, seq_len=32, layers=2, width=64, heads=4, ffn=256)
    model = cram.Crammed(c).eval()
    rows = torch.randint(0, 996, (6, 32))
    gen = torch.Generator().manual_seed(0)
    inputs, pos, labels = cram.mask_rows(rows, torch.tensor([996, 997, 998, 999]), 999, 996, gen)
    sparse = model(inputs, positions=pos, labels=labels)
    logits = model(inputs) @ model.emb.weight.T  # decoder on every position, then pick the masked ones
    dense = torch.nn.functional.cross_entropy(logits[torch.arange(6)[:, None], pos].flatten(0, 1), labels.flatten())
    assert torch.allclose(sparse, dense, atol=1e-6)
    assert abs(sparse.item() - math.log(1000)) < 0.1


def test_masking_counts_and_80_10_10():
    specials = torch.tensor([996, 997, 998, 999])
    rows = torch.randint(0, 996, (400, 128))
    rows[:, ::10] = 998  # [SEP]s must never be masked
    gen = torch.Generator().manual_seed(1)
    inputs, pos, labels = cram.mask_rows(rows, specials, 999, 996, gen)
    assert pos.shape == (400, 32) and all(len(set(p.tolist())) == 32 for p in pos)  # exactly round(0.25 x 128)
    assert (labels == rows.gather(1, pos)).all() and not torch.isin(labels, specials).any()
    got = inputs.gather(1, pos)
    frac_mask, frac_same = (got == 999).float().mean().item(), (got == labels).float().mean().item()
    assert abs(frac_mask - 0.8) < 0.01 and abs(frac_same - 0.1 - 0.1 / 996) < 0.01  # 10% kept, 10% random
    assert (got < 996).logical_or(got == 999).all()  # random replacements are ordinary tokens
    untouched = torch.ones_like(rows, dtype=torch.bool).scatter(1, pos, False)
    assert (inputs[untouched] == rows[untouched]).all()
    # a row with fewer ordinary tokens than masks: specials are picked but ignored by the loss
    short = torch.full((1, 128), 998)
    short[0, :10] = 5
    inputs, pos, labels = cram.mask_rows(short, specials, 999, 996, gen)
    assert (labels != -100).sum() == 10 and (inputs[0, 10:] == 998).all()


def test_schedule_and_ramp():
    assert [cram.schedule(x, 1e-3) for x in (0, 0.25, 0.5, 0.75, 0.9, 1)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 4e-4, 0])
    assert [cram.ramp(x, 8192, 128) for x in (0, 0.01, 0.3, 0.6, 0.9, 1)] == [1, 1, 32, 64, 64, 64]
    assert cram.ramp(0.45, 64, 32) == 2 and cram.ramp(0.1, 64, 32) == 1


def test_overfits_tiny_dataset(tmp_path, data):
    small = tmp_path / "small"
    small.mkdir()
    (small / "tokenizer.tiktoken").write_bytes(open(os.path.join(data, "tokenizer.tiktoken"), "rb").read())
    rows = np.fromfile(os.path.join(data, "train.bin"), np.uint16)[: 8 * 32]
    rows.tofile(small / "train.bin"), rows.tofile(small / "val.bin")
    meta = json.load(open(os.path.join(data, "meta.json")))
    meta["train"]["bytes"] = meta["val"]["bytes"] = rows.nbytes
    json.dump(meta, open(small / "meta.json", "w"))
    cram.main(["--data", str(small), "--out", str(tmp_path / "out"), "--steps", "500", "--lr", "3e-3", *TINY,
               "--batch-size", "8", "--log-every", "1"])
    log = records(str(tmp_path / "out"))
    assert log[0]["loss"] > 5 and log[-1]["val_loss"] < 0.5


def test_budget_is_respected(tmp_path, data):
    t0 = time.time()
    cram.main(["--data", data, "--out", str(tmp_path), "--time", "3", *TINY])
    log = records(str(tmp_path))
    steps = [r for r in log if "lr" in r]  # --log-every 0: one record per step
    assert sum(r["elapsed"] > 3.0 for r in steps) <= 1  # it stops at the first step boundary past the deadline
    assert steps[-1]["elapsed"] >= 2.95 and log[-1]["elapsed"] == 3.0  # ... and not before it (records round to 0.1 s)
    assert time.time() - t0 < 60 and "val_loss" in log[-1]
    assert cram.load_checkpoint(str(tmp_path / "ckpt.pt"))["elapsed"] <= 3.0


def run_cram(*args):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "cram.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_sigterm_checkpoint_and_exact_resume(tmp_path, data):
    common = ["--data", data, "--steps", "200", *TINY]
    full = str(tmp_path / "full")
    cram.main([*common, "--out", full])
    part = str(tmp_path / "part")
    p = run_cram(*common, "--out", part)
    while not os.path.exists(os.path.join(part, "log.jsonl")) or len(records(part)) < 20:
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 128 + signal.SIGTERM, p.stdout.read()
    ck = cram.load_checkpoint(os.path.join(part, "ckpt.pt"))
    assert 20 <= ck["step"] < 200
    cram.main([*common, "--out", part, "--resume"])
    a, b = torch.load(os.path.join(full, "ckpt.pt")), torch.load(os.path.join(part, "ckpt.pt"))
    assert b["step"] == a["step"] == 200 and b["data"] == a["data"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert records(full)[-1]["val_loss"] == records(part)[-1]["val_loss"]


def test_torchrun_two_gloo_processes_agree(tmp_path, data):
    out = str(tmp_path / "ddp")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        os.path.join(HERE, "cram.py"), "--data", data, "--out", out, "--steps", "6", *TINY],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    log = records(out)
    assert any(rec.get("ranks_agree") is True and rec["world"] == 2 for rec in log)
    assert log[-1]["seqs"] == sum(8 * 2 * cram.ramp(s / 6, 16, 16) for s in range(6))
    assert cram.load_checkpoint(os.path.join(out, "ckpt.pt"))["step"] == 6


def test_bench_prints_tokens_per_second(capsys):
    tok_s = cram.main(["--bench", "--bench-steps", "2", "--vocab-size", "500", *TINY])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert tok_s > 0 and f"tokens/s={tok_s:.0f}" in last


def test_eval_on_held_out_text(tmp_path, data, capsys):
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "3", *TINY])
    meta, held = prep(str(tmp_path), make_docs(40, seed=11), "--tokenizer", data, name="held")
    rows = meta["train"]["rows"] + meta["val"]["rows"]
    v = cram.main(["--data", held, "--out", str(tmp_path), "--eval", *TINY, "--eval-rows", "100000"])
    out = capsys.readouterr().out
    assert f"on {rows:,} rows of {held}: {v:.4f}; it guesses" in out and 3 < v < 7
    assert "% of the masked tokens" in out and 0 <= records(str(tmp_path))[-1]["val_acc"] <= 1
    cram.main(["--data", held, "--out", str(tmp_path), "--eval", *TINY, "--eval-rows", "5"])
    assert "on 5 rows of" in capsys.readouterr().out  # reads only the rows it needs
    assert v == cram.main(["--data", held, "--out", str(tmp_path), "--eval", *TINY, "--eval-rows", "100000"])
    _, other = prep(str(tmp_path), make_docs(200, seed=12), name="other")  # a tokenizer of its own
    with pytest.raises(SystemExit, match="trained with another tokenizer"):
        cram.main(["--data", other, "--out", str(tmp_path), "--eval", *TINY])


def test_non_finite_steps_are_skipped_then_abort(tmp_path, data, monkeypatch):
    ce = cram.F.cross_entropy
    monkeypatch.setattr(cram.F, "cross_entropy", lambda *a, **k: ce(*a, **k) * float("nan"))
    with pytest.raises(SystemExit, match="not finite for 20 steps in a row at step 19"):
        cram.main(["--data", data, "--out", str(tmp_path), "--steps", "100", *TINY])
    calls = iter(range(10 ** 6))

    def flaky(*a, **k):  # three bad micro-batches at the start: skipped, counted, then training goes on
        return ce(*a, **k) * (float("nan") if next(calls) < 3 else 1.0)
    monkeypatch.setattr(cram.F, "cross_entropy", flaky)
    cram.main(["--data", data, "--out", str(tmp_path / "b"), "--steps", "10", *TINY])
    assert records(str(tmp_path / "b"))[-2]["skipped"] == 3 and cram.load_checkpoint(str(tmp_path / "b" / "ckpt.pt"))["skipped"] == 3


def test_clear_errors(tmp_path, data):
    with pytest.raises(SystemExit, match="none: no prepared data .*run prepare.py"):
        cram.main(["--data", str(tmp_path / "none"), "--out", str(tmp_path), *TINY])
    (tmp_path / "ckpt.pt").write_bytes(b"garbage")
    with pytest.raises(SystemExit, match="ckpt.pt: corrupt or unreadable checkpoint"):
        cram.main(["--data", data, "--out", str(tmp_path), "--resume", *TINY])
    torch.save({"something": "else"}, tmp_path / "ckpt.pt")
    with pytest.raises(SystemExit, match="ckpt.pt: not a cram checkpoint"):
        cram.main(["--data", data, "--out", str(tmp_path), "--resume", *TINY])
    cram.main(["--data", data, "--out", str(tmp_path / "a"), "--steps", "1", *TINY])
    other, out = prep(str(tmp_path), make_docs(200), name="other")
    meta = json.load(open(os.path.join(out, "meta.json")))
    meta["seq_len"] = 16
    json.dump(meta, open(os.path.join(out, "meta.json"), "w"))
    with pytest.raises(SystemExit, match="seq len 32 do not match"):
        cram.main(["--data", out, "--out", str(tmp_path / "a"), "--resume", *TINY])




def test_compiled_training_step_matches_eager_on_cpu(tmp_path):
    """Guards the GPU path in CI: one graph (fullgraph), bf16 autocast, no recompilation."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    c = cram.ModelConfig(vocab_size=512, seq_len=32, layers=2, width=64, heads=2, ffn=128)
    model = cram.Crammed(c)
    masker = cram.Masker({"[PAD]": 508, "[CLS]": 509, "[SEP]": 510, "[MASK]": 511}, torch.device("cpu"))
    compiled = torch.compile(model, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(2):  # a second batch must reuse the graph: static shapes
            batch = masker(torch.randint(0, 508, (8, 32)), seed)
            with torch.autocast("cpu", torch.bfloat16):
                eager, fast = model(**batch), compiled(**batch)
            fast.backward()
            assert abs(eager.item() - fast.item()) < 0.02 * eager.item()
    assert all(p.grad is not None for p in model.parameters())


def test_ddp_accumulates_on_a_shared_clock_and_resumes(tmp_path, data):
    """The paper's settings under torchrun: accumulation (batch 64 = 4 x 8 x 2), a time budget
    read from one clock, SIGTERM, --resume; the replicas agree at the end."""
    out = str(tmp_path / "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "cram.py"), "--data", data, "--out", out, "--time", "12", *TINY,
           "--batch-size", "64"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not os.path.exists(os.path.join(out, "log.jsonl")) or max(
            (r.get("batch", 0) for r in records(out)), default=0) < 32:  # accumulating
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    p.wait(120)
    step = cram.load_checkpoint(os.path.join(out, "ckpt.pt"))["step"]
    r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    log = records(out)
    assert any(rec.get("ranks_agree") is True and rec["world"] == 2 for rec in log)
    assert cram.load_checkpoint(os.path.join(out, "ckpt.pt"))["step"] > step and "val_loss" in log[-1]


def test_out_folder_holds_a_run(tmp_path, data):
    out = str(tmp_path / "run")
    cram.main(["--data", data, "--out", out, "--steps", "2", *TINY])
    before = open(os.path.join(out, "ckpt.pt"), "rb").read()
    with pytest.raises(SystemExit, match="holds a run .*ckpt.pt.*--resume"):
        cram.main(["--data", data, "--out", out, "--steps", "2", *TINY])
    assert open(os.path.join(out, "ckpt.pt"), "rb").read() == before
    with open(os.path.join(out, "lock"), "w") as lock:  # as a second cram.py would find it
        import fcntl
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match="another cram.py is training into it"):
            cram.main(["--data", data, "--out", out, "--resume", *TINY])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="--out .*file: cannot write there"):
        cram.main(["--data", data, "--out", str(tmp_path / "file"), *TINY])


@pytest.mark.parametrize("flag,value", [("--time", "0"), ("--time", "-5"), ("--time", "inf"),
                                        ("--steps", "0"), ("--micro-batch", "0"), ("--lr", "nan"),
                                        ("--layers", "-1"), ("--log-every", "-1"),
                                        ("--eval-rows", "0"), ("--batch-size", "4")])
def test_out_of_range_flags(flag, value, data, tmp_path):
    with pytest.raises(SystemExit, match=f"error: {flag} {value}"):
        cram.main(["--data", data, "--out", str(tmp_path), *TINY, flag, value])
    assert not os.path.exists(tmp_path / "log.jsonl")


def test_damaged_data_is_named_at_start(tmp_path, data):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(data):
        (bad / f).write_bytes(open(os.path.join(data, f), "rb").read())
    with open(bad / "val.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(SystemExit, match="val.bin: 100 bytes, but meta.json says .*damaged"):
        cram.main(["--data", str(bad), "--out", str(tmp_path / "o"), *TINY])
    os.remove(bad / "train.bin")
    with pytest.raises(SystemExit, match="train.bin: missing"):
        cram.main(["--data", str(bad), "--out", str(tmp_path / "o"), *TINY])


def test_fill_masks_with_top_5(tmp_path, data, capsys):
    cram.main(["--data", data, "--out", str(tmp_path), "--steps", "30", "--lr", "3e-3", *TINY])
    answers = cram.main(["--out", str(tmp_path), "--fill", "The cat [MASK] on the mat.",
                         "a [MASK] dog [MASK] far", "--device", "cpu"])
    out = capsys.readouterr().out
    assert len(answers) == 3 and all(len(a) == 5 for a in answers) and "[MASK] 2:" in out
    assert all(1 >= a[0][1] >= a[4][1] > 0 for a in answers)
    enc = prepare.load_tokenizer(prepare.read_prepared(data)[1])
    ids = cram.encode_masked("The Cat [MASK] on it", enc, 999)
    assert ids == enc.encode_ordinary("the cat") + [999] + enc.encode_ordinary(" on it")
    with pytest.raises(SystemExit, match="no \\[MASK\\] in it"):
        cram.main(["--out", str(tmp_path), "--fill", "no mask here"])
    with pytest.raises(SystemExit, match="no checkpoint here"):
        cram.main(["--out", str(tmp_path / "nothing"), "--fill", "a [MASK]"])


def test_alibi_penalises_distance_and_respects_padding():
    torch.manual_seed(0)
    c = cram.ModelConfig(vocab_size=300, seq_len=16, layers=2, width=32, heads=2, ffn=64, alibi=1.0)
    model = cram.Crammed(c).eval()
    assert model.alibi[0, 3, :6].tolist() == [-3, -2, -1, 0, -1, -2]  # slope 1 on head 0
    assert model.alibi[1, 0, 4].item() == -2  # slope 1/2 on head 1
    x = torch.randint(0, 296, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, 10:] = False  # row 0 is 10 real tokens and padding
    padded, alone = model(x, mask), model(x[:1, :10])
    assert torch.allclose(padded[0, :10], alone[0], atol=1e-5)
    assert cram.get_args(["--preset", "tiny"]).alibi == 1 and cram.get_args([]).alibi == 0
