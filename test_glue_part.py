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

# ----------------------------------------------------------------------------- glue.py
# A few rows of each task in the exact GLUE layout (tabs, headers, BOM, label spellings).
MNLI_COLS = "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\tsentence2_parse\tsentence1\tsentence2"
FIXTURES = {
    "CoLA": {"train.tsv": "gj04\t1\t\tOur friends won't buy this analysis.\ngj04\t0\t*\tThey drank the pub.\n",
             "dev.tsv": "gj04\t1\t\tThe sailors rode the breeze clear of the rocks."},  # the real dev.tsv has no final newline
    "SST-2": {"train.tsv": "sentence\tlabel\nhide new secretions from the parental units \t0\nit 's a charming journey . \t1\n",
              "dev.tsv": "sentence\tlabel\nunflinchingly bleak and desperate \t0\n"},
    "MRPC": {"train.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t702876\t702977\tAmrozi accused his brother .\t"
                          "Referring to him as \" the witness \" .\n0\t2108705\t2108831\tYucaipa owned Dominick 's .\tYucaipa bought Dominick 's .\n",
             "dev.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1355540\t1355592\tHe said so .\t\" He said so .\n"},
    "STS-B": {"train.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                           "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn air plane is taking off.\t5.000\n"
                           "1\tmain-captions\tMSRvid\t2012test\t0004\tnone\tnone\tA man is playing a large flute.\tA man is playing a flute.\t3.800\n",
              "dev.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                         "0\tmain-captions\tMSRvid\t2012test\t0000\tnone\tnone\tA man is dancing.\tA man wearing a hat is dancing.\t0.250\n"},
    "QQP": {"train.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n133273\t213221\t213222\tHow is the life of a math student?\t"
                         "Which level of prepration is enough?\t0\n402555\t536040\t536041\tHow do I control my horny emotions?\tHow do you control your horniness?\t1\n",
            "dev.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t2\t3\tWhy \"this\"?\tWhy that?\t0\n"},
    "MNLI": {"train.tsv": f"{MNLI_COLS}\tlabel1\tgold_label\n0\t31193\t31193n\tgovernment\t( ( a ) b )\t( c )\t(ROOT (S a))\t(ROOT (S c))\t"
                          "Conceptually cream skimming has two basic dimensions.\tProduct and geography are what make cream skimming work. \tneutral\tneutral\n",
             "dev_matched.tsv": f"{MNLI_COLS}\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n0\t63735\t63735n\tslate\t( a )\t( b )\t(ROOT a)\t(ROOT b)\t"
                                "The new rights are nice enough\tEveryone really likes the newest benefits \tneutral\tentailment\tneutral\tneutral\tneutral\tneutral\n",
             "dev_mismatched.tsv": f"{MNLI_COLS}\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n0\t75290\t75290c\tletters\t( a )\t( b )\t(ROOT a)\t(ROOT b)\t"
                                   "Your contribution helped.\tYour contributions were of no help.\tcontradiction\tcontradiction\tcontradiction\tcontradiction\tcontradiction\tcontradiction\n"},
    "QNLI": {"train.tsv": "index\tquestion\tsentence\tlabel\n0\tWhen did the third Digimon series begin?\tUnlike the two seasons before it.\tnot_entailment\n",
             "dev.tsv": "index\tquestion\tsentence\tlabel\n0\tWhat came into force?\tThe new constitution came into force.\tentailment\n"},
    "RTE": {"train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tNo Weapons of Mass Destruction Found in Iraq Yet.\tWeapons of Mass Destruction Found in Iraq.\tnot_entailment\n",
            "dev.tsv": "index\tsentence1\tsentence2\tlabel\n0\tDana Reeve has died.\tDana Reeve is dead.\tentailment\n"},
    "WNLI": {"train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tI stuck a pin through a carrot.\tThe carrot had a hole.\t1\n",
             "dev.tsv": "index\tsentence1\tsentence2\tlabel\n0\tThe drain is clogged with hair.\tThe hair has to be cleaned.\t0\n"},
}


def write_files(folder, files):
    os.makedirs(folder, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8", newline="") as f:
            f.write(text)


def test_glue_parsers_read_every_task_format(tmp_path):
    for task, files in FIXTURES.items():
        write_files(tmp_path / task, files)
    rd = lambda task, f="train.tsv": glue.read_tsv(str(tmp_path / task / f), task)
    assert rd("CoLA") == [("Our friends won't buy this analysis.", None, 1), ("They drank the pub.", None, 0)]
    assert rd("CoLA", "dev.tsv") == [("The sailors rode the breeze clear of the rocks.", None, 1)]
    assert rd("SST-2")[1] == ("it 's a charming journey . ", None, 1)
    assert rd("MRPC") == [("Amrozi accused his brother .", "Referring to him as \" the witness \" .", 1),
                          ("Yucaipa owned Dominick 's .", "Yucaipa bought Dominick 's .", 0)]
    assert rd("STS-B") == [("A plane is taking off.", "An air plane is taking off.", 5.0),
                           ("A man is playing a large flute.", "A man is playing a flute.", 3.8)]
    assert rd("QQP")[1] == ("How do I control my horny emotions?", "How do you control your horniness?", 1)
    assert rd("QQP", "dev.tsv") == [("Why \"this\"?", "Why that?", 0)]
    assert rd("MNLI") == [("Conceptually cream skimming has two basic dimensions.",
                           "Product and geography are what make cream skimming work. ", 1)]
    assert rd("MNLI", "dev_matched.tsv")[0][2] == 1 and rd("MNLI", "dev_mismatched.tsv")[0][2] == 2
    assert rd("QNLI") == [("When did the third Digimon series begin?", "Unlike the two seasons before it.", 1)]
    assert rd("RTE", "dev.tsv") == [("Dana Reeve has died.", "Dana Reeve is dead.", 0)]
    assert rd("WNLI") == [("I stuck a pin through a carrot.", "The carrot had a hole.", 1)]
    assert [glue.task_name(t) for t in ["cola", "SST-2", "sst2", "Mrpc", "sts-b", "QQP", "mnli", "qnli", "RTE", "wnli"]] == \
        ["CoLA", "SST-2", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE", "WNLI"]


def test_glue_bad_input_names_file_and_line(tmp_path):
    path = str(tmp_path / "train.tsv")
    cases = [("RTE", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\n", ":3: expected 4 tab-separated columns, found 3"),
             ("RTE", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tyes\n", ":2: unknown label 'yes'"),
             ("STS-B", FIXTURES["STS-B"]["train.tsv"].replace("3.800", "high"), ":3: score 'high' is not a number"),
             ("CoLA", "gj04\t1\t\tfine.\ngj04\t1\t\ttoo\tmany\n", ":2: expected 4"),
             ("QNLI", "index\tsentence1\tsentence2\tlabel\n", ":1: no column 'question'")]
    for task, text, msg in cases:
        write_files(tmp_path, {"train.tsv": text})
        with pytest.raises(SystemExit, match="error: " + path + msg):
            glue.read_tsv(path, task)
    with pytest.raises(SystemExit, match="missing GLUE file .*nope.tsv"):
        glue.read_tsv(str(tmp_path / "nope.tsv"), "RTE")
    with pytest.raises(SystemExit, match="unknown GLUE task 'mnli-m'"):
        glue.task_name("mnli-m")


def test_glue_metrics_against_hand_computed_values():
    p, y = [1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 0]  # tp 2, tn 2, fp 1, fn 1
    assert glue.accuracy(p, y) == pytest.approx(4 / 6)
    assert glue.f1(p, y) == pytest.approx(2 / 3)  # precision 2/3, recall 2/3
    assert glue.mcc(p, y) == pytest.approx((2 * 2 - 1 * 1) / 9)  # sqrt(3*3*3*3) = 9
    assert glue.mcc(y, y) == pytest.approx(1.0) and glue.mcc([1 - v for v in y], y) == pytest.approx(-1.0)
    assert glue.mcc([1] * 6, y) == 0.0 and glue.mcc([0] * 6, y) == 0.0  # a constant predictor: 0, not nan
    assert glue.f1([0] * 6, y) == 0.0 and glue.f1([1] * 6, y) == pytest.approx(2 * 3 / (2 * 3 + 3))
    big = np.array([1, 0] * 300_000)  # counts whose 4-fold product overflows int64
    assert glue.mcc(big, big) == pytest.approx(1.0)
    assert glue.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert glue.pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)  # sum of products 1 over sqrt(2 x 2)
    assert glue.pearson([2, 2, 2], [1, 2, 3]) == 0.0
    assert list(glue.ranks([10, 20, 20, 5])) == [2.0, 3.5, 3.5, 1.0]
    assert glue.spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)
    assert glue.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4], [1, 2, 3, 4])[0, 1])
    assert glue.score("MRPC", p, y) == {"f1": pytest.approx(200 / 3), "accuracy": pytest.approx(400 / 6)}
    assert glue.glue_score({"RTE": {"accuracy": 60.0}, "CoLA": {"mcc": 40.0}, "WNLI": {"accuracy": 0.0}}) == (50.0, ["RTE", "CoLA"])


def test_glue_encode_pairs_and_truncation():
    specials = {"[PAD]": 256, "[CLS]": 257, "[SEP]": 258, "[MASK]": 259}
    enc = glue.load_tokenizer(tokenizer())
    ids, ys = glue.encode(enc, specials, [("Ab", "c", 1), ("x" * 20, "y" * 3, 0), ("q" * 9, None, 1)], max_len=10)
    assert ids[0] == [257, ord("a"), ord("b"), 258, ord("c"), 258]  # normalised: lowercase
    assert ids[1] == [257] + [ord("x")] * 4 + [258] + [ord("y")] * 3 + [258]  # the longer text is cut
    assert ids[2] == [257] + [ord("q")] * 8 + [258] and ys.tolist() == [1, 0, 1]


# ----------------------------------------------------------------------------- downloads
def test_glue_download_unzips_and_builds_mrpc(tmp_path, http_server, monkeypatch):
    url, h = http_server
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:  # laid out like GLUE's zips: a folder per task
        for name, text in FIXTURES["RTE"].items():
            z.writestr(f"RTE/{name}", text)
        z.writestr("RTE/test.tsv", "index\tsentence1\tsentence2\n")
        z.writestr("RTE/original/train.tsv", "not this one\n")
    h.FILES["/RTE.zip"] = buf.getvalue()
    lines = ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String", "1\t702876\t702977\tAmrozi accused .\tReferring to him .",
             "0\t1355540\t1355592\tHe said .\tHe did .", "1\t2108705\t2108831\tYucaipa owned .\tYucaipa bought ."]
    h.FILES["/msr_paraphrase_train.txt"] = "\r\n".join(lines).encode() + b"\r\n"  # CRLF, as SentEval ships it
    h.FILES["/mrpc_dev_ids.tsv"] = b"1355540\t1355592\n"
    monkeypatch.setattr(glue, "GLUE_URL", url + "/{}.zip")
    monkeypatch.setattr(glue, "MRPC_URL", url + "/msr_paraphrase_train.txt")
    monkeypatch.setattr(glue, "MRPC_DEV_IDS_URL", url + "/mrpc_dev_ids.tsv")
    glue_dir = str(tmp_path / "glue")
    folder = glue.ensure_task("RTE", glue_dir)
    assert sorted(os.listdir(folder)) == ["dev.tsv", "train.tsv"] and not os.path.exists(os.path.join(glue_dir, "RTE.zip"))
    assert open(os.path.join(folder, "train.tsv")).read() == FIXTURES["RTE"]["train.tsv"]
    assert glue.read_tsv(os.path.join(folder, "dev.tsv"), "RTE") == [("Dana Reeve has died.", "Dana Reeve is dead.", 0)]
    folder = glue.ensure_task("MRPC", glue_dir)
    header = lines[0].encode() + b"\n"
    assert open(os.path.join(folder, "dev.tsv"), "rb").read() == header + lines[2].encode() + b"\n"
    assert open(os.path.join(folder, "train.tsv"), "rb").read() == header + (lines[1] + "\n" + lines[3] + "\n").encode()
    assert [r[2] for r in glue.read_tsv(os.path.join(folder, "train.tsv"), "MRPC")] == [1, 1]
    del h.FILES["/RTE.zip"]
    assert glue.ensure_task("RTE", glue_dir) == folder.replace("MRPC", "RTE")  # present: no network needed
    with pytest.raises(SystemExit, match=r"HTTP 404.*CoLA.zip.*train.tsv, dev.tsv in .*glue/CoLA"):
        glue.ensure_task("CoLA", glue_dir)
    h.FILES["/STS-B.zip"] = b"<html>not a zip</html>"
    with pytest.raises(SystemExit, match=r"STS-B.zip is not a valid zip file"):
        glue.ensure_task("STS-B", glue_dir)


# ----------------------------------------------------------------------------- fine-tuning
def tokenizer():
    """Bytes only: enough for the model to read letters."""
    return {"ranks": "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)),
            "pattern": r"\S+|\s+", "special_tokens": {"[PAD]": 256, "[CLS]": 257, "[SEP]": 258, "[MASK]": 259}}


def make_ckpt(path):
    cfg = ModelConfig(vocab_size=260, seq_len=64, layers=2, width=64, heads=2, ffn=128)
    torch.manual_seed(0)
    torch.save({"format": "cram-ckpt-1", "model_config": asdict(cfg), "model": Crammed(cfg).state_dict(),
                "tokenizer": tokenizer()}, path)




def test_glue_finetune_learns_a_synthetic_task(tmp_path, capsys, one_thread):
    rng = random.Random(0)
    words = ["the", "film", "was", "plot", "actor", "and", "a", "it", "long", "scene"]

    def rows(n):  # sentiment decided by one word among filler
        out = []
        for _ in range(n):
            y = rng.randint(0, 1)
            w = [rng.choice(words) for _ in range(rng.randint(2, 6))]
            w.insert(rng.randint(0, len(w)), "great" if y else "awful")
            out.append(f"{' '.join(w)} \t{y}\n")
        return "sentence\tlabel\n" + "".join(out)
    write_files(tmp_path / "glue" / "SST-2", {"train.tsv": rows(640), "dev.tsv": rows(200)})
    write_files(tmp_path / "glue" / "RTE", FIXTURES["RTE"])
    ckpt = str(tmp_path / "ckpt.pt")
    make_ckpt(ckpt)
    common = ["--ckpt", ckpt, "--glue-dir", str(tmp_path / "glue"), "--device", "cpu", "--max-len", "64"]
    res = glue.main(common + ["--tasks", "sst2", "--epochs", "5", "--lr", "1e-3"])
    assert res["SST-2"]["accuracy"] > 90
    saved = json.load(open(tmp_path / "glue.json"))
    assert saved["SST-2"]["accuracy"] == res["SST-2"]["accuracy"] and saved["average_over"] == ["SST-2"]
    cap = capsys.readouterr()  # progress lines go to stderr (prepare.Progress), the table to stdout
    assert "SST-2 trial 1/1: " in cap.err and "epoch 5/5" in cap.err and "ex/s" in cap.err and "ETA" in cap.err
    assert "crammed BERT v1" in cap.out
    res = glue.main(common + ["--tasks", "rte", "--epochs", "1", "--trials", "2", "--random-init"])
    assert set(json.load(open(tmp_path / "glue-random-init.json"))["trials"]["RTE"][1]) == {"accuracy"}
    with pytest.raises(SystemExit, match="--max-len 65: must be from 4 to 64"):
        glue.main(common[:-1] + ["65", "--tasks", "rte"])
    with open(ckpt, "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(SystemExit, match=f"error: {ckpt}: corrupt"):
        glue.main(common + ["--tasks", "rte"])



# ----------------------------------------------------------------------------- nothing lost, no traceback
def fake_finetune(calls):
    """Stands in for fine-tuning: a score that says which call made it."""
    def finetune(ckpt, task, train, devs, args, trial, device, pad):
        calls.append(task)
        return {split: {m: float(len(calls)) for m in glue.METRICS.get(task, ["accuracy"])} for split in devs}
    return finetune


@pytest.fixture
def glue_run(tmp_path, monkeypatch):
    """A checkpoint, RTE and WNLI files, and main() with fine-tuning replaced by fake_finetune."""
    for task in ("RTE", "WNLI"):
        write_files(tmp_path / "glue" / task, FIXTURES[task])
    ckpt = str(tmp_path / "ckpt.pt")
    make_ckpt(ckpt)
    calls = []
    monkeypatch.setattr(glue, "finetune", fake_finetune(calls))

    def run(*flags):
        return glue.main(["--ckpt", ckpt, "--glue-dir", str(tmp_path / "glue"), "--device", "cpu", "--max-len", "64", *flags])
    return run, calls, tmp_path


def test_glue_json_merges_runs(glue_run):
    run, calls, tmp = glue_run
    run("--tasks", "wnli")
    run("--tasks", "rte", "--seed", "3")
    saved = json.load(open(tmp / "glue.json"))
    assert saved["WNLI"] == {"accuracy": 1.0} and saved["RTE"] == {"accuracy": 2.0}  # both kept
    assert saved["average"] == 2.0 and saved["average_over"] == ["RTE"]  # WNLI is not in the score
    assert saved["settings"]["WNLI"]["seed"] == 0 and saved["settings"]["RTE"]["seed"] == 3
    run("--tasks", "rte", "--trials", "2")  # a rerun replaces RTE only
    saved = json.load(open(tmp / "glue.json"))
    assert saved["WNLI"] == {"accuracy": 1.0} and saved["RTE"] == {"accuracy": 3.5}  # median of 3, 4
    assert saved["trials"]["RTE"] == [{"accuracy": 3.0}, {"accuracy": 4.0}] and saved["trials"]["WNLI"]
    assert saved["average"] == 3.5 and calls == ["WNLI", "RTE", "RTE", "RTE"]
    (tmp / "glue.json").write_text('{"RTE": {"accuracy": 5')  # corrupt: a clear error, the file untouched
    with pytest.raises(SystemExit, match=r"^error: \S*glue.json: not a glue.py results file.*move it aside to start anew$"):
        run("--tasks", "wnli")
    assert (tmp / "glue.json").read_text() == '{"RTE": {"accuracy": 5' and len(calls) == 4


def test_glue_checks_every_file_before_fine_tuning(glue_run, capsys):
    run, calls, tmp = glue_run
    write_files(tmp / "glue" / "WNLI", {"dev.tsv": "index\tsentence1\tsentence2\tlabel\n0\ta\tb\t7\n"})
    with pytest.raises(SystemExit, match=r"WNLI/dev.tsv:2: unknown label '7'"):
        run("--tasks", "rte,wnli")
    assert calls == [] and not os.path.exists(tmp / "glue.json") and "trial" not in capsys.readouterr().err


def test_glue_unwritable_output_fails_up_front(glue_run, tmp_path):
    run, calls, tmp = glue_run
    (tmp / "a-file").write_text("")  # a file where the output folder should be: fails even as root
    with pytest.raises(SystemExit, match=r"^error: \S*a-file: cannot write the results there \(.*\)$"):
        run("--tasks", "rte", "--out", str(tmp / "a-file" / "glue.json"))
    ro = tmp / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if not os.access(ro, os.W_OK):  # root writes anyway: then the case above is the check
            with pytest.raises(SystemExit, match=r"read-only/glue.json.probe.tmp: cannot write the results there"):
                run("--tasks", "rte", "--out", str(ro / "glue.json"))
    finally:
        ro.chmod(0o755)
    assert calls == []


def test_glue_flags_out_of_range(glue_run):
    run, calls, _ = glue_run
    for flags, msg in [(["--epochs", "0"], "--epochs 0: must be at least 1"),
                       (["--lr", "0"], "--lr 0.0: must be above 0 and at most 1"),
                       (["--lr", "nan"], "--lr nan: must be above 0"), (["--lr", "2"], "--lr 2.0: must be"),
                       (["--batch-size", "-1"], "--batch-size -1: must be at least 1"),
                       (["--trials", "0"], "--trials 0: must be at least 1"),
                       (["--seed", "-1"], r"--seed -1: must be from 0 to 2\*\*32 - 1"),
                       (["--max-len", "3"], "--max-len 3: must be at least 4"),
                       (["--max-len", "65"], "--max-len 65: must be from 4 to 64"),
                       (["--tasks", ","], "--tasks: name at least one task"),
                       (["--epochs", "x"], "argument --epochs: invalid int value: 'x'"),
                       (["--device", "nope"], "--device nope: .*device string: nope$")]:
        with pytest.raises(SystemExit, match="^error: " + msg):
            run("--tasks", "rte", *flags)
    assert calls == []
    r = subprocess.run([sys.executable, os.path.join(HERE, "glue.py"), "--ckpt", "x.pt", "--epochs", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr == "error: --epochs 0: must be at least 1\n"  # one line, no traceback


def test_glue_head_help_and_truncation_example(capsys):
    cfg = ModelConfig(vocab_size=260, seq_len=64, layers=1, width=64, heads=2, ffn=128)
    model = glue.Classifier(Crammed(cfg), 3)  # the encoder is built by the caller
    assert glue.HEAD_DIM == 1024 and model.pooler[0].out_features == 1024 and model.head.in_features == 1024
    assert model.pooler[2].p == glue.DROPOUT == 0.1
    assert model(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool)).shape == (2, 3)
    with pytest.raises(SystemExit):
        glue.get_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag, name in [("lr", "LR"), ("epochs", "EPOCHS"), ("batch-size", "BATCH_SIZE"), ("max-len", "MAX_LEN")]:
        assert f"--{flag} {flag.upper().replace('-', '_')} " in help_text
        assert f"(default: {getattr(glue, name)})" in help_text

    def cut(a, b, room):  # the worked example of truncate's docstring, in lengths
        return tuple(map(len, glue.truncate(list(range(a)), list(range(b)), room)))
    assert cut(100, 60, 125) == (65, 60) and cut(100, 90, 125) == (63, 62) and cut(200, 0, 126) == (126, 0)
