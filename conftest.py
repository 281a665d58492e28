"""TEMPORARY: shared fixtures while test files are split; merged back into test_cram.py."""
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

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = ("the a cat dog sat on mat ran far away over hill under tree king queen said that it was "
         "very good bad day night old new house river stone green red blue small large").split()


def make_docs(n, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))) + "." for _ in range(n)]


def write_jsonl(path, docs):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return str(path)


def prep(tmp, docs=None, *extra, name="data"):
    src = write_jsonl(os.path.join(tmp, f"{name}.jsonl"), docs or make_docs(200))
    out = os.path.join(tmp, name)
    return prepare.main(["--input", src, "--out", out, "--vocab-size", "350", "--seq-len", "32", "--trash", "1", *extra]), out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prep(str(tmp_path_factory.mktemp("data")))[1]


# ----------------------------------------------------------------------------- a loopback server
class Handler(http.server.BaseHTTPRequestHandler):
    """Serves FILES; honours Range; paths in BROKEN send half the body and hang up."""
    FILES, BROKEN, hits = {}, set(), []

    def do_GET(self):
        self.hits.append((self.path, self.headers.get("Range")))
        body = self.FILES.get(self.path)
        if not isinstance(body, bytes):
            self.send_error(body or 404)
            return
        start = int(self.headers["Range"][6:].split("-")[0]) if self.headers.get("Range") else 0
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        if self.path in self.BROKEN:
            self.wfile.write(body[start: start + (len(body) - start) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body[start:])

    def log_message(self, *a):
        pass


@pytest.fixture
def http_server(monkeypatch):
    monkeypatch.setattr(prepare, "BACKOFF", 0.01)
    Handler.FILES.clear(), Handler.BROKEN.clear(), Handler.hits.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", Handler
    server.shutdown()



@pytest.fixture
def one_thread():  # tiny models on a shared CPU: a second thread only adds contention
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
