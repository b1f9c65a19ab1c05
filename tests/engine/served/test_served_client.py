"""engine=served on a client machine (issue 31): its tokenizer loaded by transformers alone gives vLLM's ids, and a
run needs neither vLLM nor torch; the served engine's concurrency follows the server.

Run: .venv/bin/python -m pytest tests/engine/served/test_served_client.py -q -x (the engine-marked test starts the session server)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import DEPLOYMENT, SERVER_KEY
from tests.engine.served.local_http import QuietHandler, answer_json, running

# Texts with the embedded model's special tokens in them, spaces, newlines and non-ASCII text: every one must get
# the same ids from both loaders, with and without the special tokens a tokenizer adds.
TEXTS = ["The capital of France is", "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
         "<|endoftext|>after the end", "", "  two spaces\tand a tab\n\nand newlines  ", "é ü 数学 🙂",
         "Question: 17 * 23 =\nAnswer: 391", "<|im_end|><|im_start|>"]

# PYTHONPATH'd before a subprocess's own: Python's path finder, blind to vllm and torch (their modules and their
# package metadata), as on a machine where neither is installed (importlib.util.find_spec says None, as lm-eval
# and transformers ask).
HIDE = '''import sys
from importlib.machinery import PathFinder

HIDDEN = ("vllm", "torch")


class Hidden:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return None if name.split(".")[0] in HIDDEN else PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):
        return (d for d in PathFinder.find_distributions(*args, **kwargs)
                if (d.metadata["Name"] or "").lower().removesuffix("-cpu") not in HIDDEN)

    invalidate_caches = staticmethod(PathFinder.invalidate_caches)


sys.meta_path[:] = [Hidden if finder is PathFinder else finder for finder in sys.meta_path]
'''


@pytest.fixture(scope="module")
def bos_folder(embedded_model_dir, tmp_path_factory) -> str:
    """The embedded tokenizer saved as one that adds BOS by default (as Llama-2's does), with the model's config."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("bos")
    AutoTokenizer.from_pretrained(embedded_model_dir, add_bos_token=True).save_pretrained(folder)
    (folder / "config.json").write_text(Path(embedded_model_dir, "config.json").read_text())
    return str(folder)


def ids_of(tokenizer) -> list:
    return [(text, special, list(tokenizer(text, add_special_tokens=special).input_ids))
            for text in TEXTS for special in (True, False)]


@pytest.mark.parametrize("case", ["embedded", "bos folder", "embedded, add_bos_token=true"])
def test_transformers_loads_the_ids_vllm_loads(case, embedded_model_dir, bos_folder):
    from evalkit.engine.tokenizer import load_tokenizer

    path = bos_folder if case == "bos folder" else embedded_model_dir
    add_bos = True if "add_bos_token" in case else None
    alone = load_tokenizer(path, trust_remote_code=False, add_bos_token=add_bos, with_vllm=False)
    with_vllm = load_tokenizer(path, trust_remote_code=False, add_bos_token=add_bos)
    assert "vllm" not in type(alone).__module__ and type(with_vllm).__name__.startswith("Cached")  # two loaders
    assert ids_of(alone) == ids_of(with_vllm)
    adds_bos = case != "embedded"
    assert (alone("hi").input_ids[0] == alone.bos_token_id) == adds_bos  # the BOS cases really add one
    for name in ("bos_token_id", "eos_token_id", "truncation_side", "chat_template", "name_or_path"):
        assert getattr(alone, name) == getattr(with_vllm, name), name
    assert alone.decode(ids_of(alone)[2][2]) == with_vllm.decode(ids_of(alone)[2][2])


def test_a_mistral_format_folder_without_vllm_is_one_line(tmp_path):
    """A folder only vLLM's mistral mode reads, on a machine without vLLM: one line naming the way out."""
    (tmp_path / "tekken.json").write_text("{}")
    code = ("from evalkit.engine.tokenizer import load_tokenizer\n"
            f"load_tokenizer({str(tmp_path)!r}, trust_remote_code=False, add_bos_token=None, with_vllm=False)")
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(hide)})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"ValueError: the tokenizer at {tmp_path} is in Mistral's format (tekken.json or tokenizer.model.v*), which "
        "only vLLM's loader reads: install vLLM beside evalkit, or pass tokenizer= a folder in Hugging Face's format")


@pytest.mark.engine
def test_served_runs_without_vllm_and_torch(served, tmp_path):
    """python -m evalkit engine=served against the session's server, in processes where vllm and torch cannot be
    imported (nor found by importlib.util.find_spec or importlib.metadata): the run finishes with the scores the
    probe-checked server gives."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    blind = subprocess.run([sys.executable, "-c", "import importlib.util as u\nfor m in ('vllm', 'torch'):\n"
                            "    assert u.find_spec(m) is None, m\n    try:\n        __import__(m)\n"
                            "    except ImportError:\n        continue\n    raise SystemExit(m + ' imported')"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert blind.returncode == 0, blind.stderr  # the hiding holds
    done = subprocess.run([sys.executable, "-m", "evalkit", "engine=served", f"endpoint.url={served.client.url}",
                           DEPLOYMENT, SERVER_KEY, "tasks=[evalkit_arith,evalkit_facts]", "limit=4", f"output_dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results.json")
    written = json.loads(results.read_text())
    assert set(written["results"]) >= {"evalkit_arith", "evalkit_facts"}


class Batching(QuietHandler):
    """A server that runs BATCH requests at once (0.1 s each) and queues the rest, and says so on /metrics as vLLM
    does; /nometrics-* paths answer the same with no /metrics. Each arrival records how many were waiting."""

    BATCH = 4
    lock = threading.Condition()
    running = [0]
    waiting = [0]
    arrivals: list = []
    metrics = True

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path != "/metrics" or not type(self).metrics:
            self.send_response(404)
            self.end_headers()
            return
        text = (f'# HELP vllm:num_requests_running x\nvllm:num_requests_running{{engine="0"}} {self.running[0]}.0\n'
                f'vllm:num_requests_waiting{{engine="0"}} {self.waiting[0]}.0\n')
        self.send_response(200)
        self.end_headers()
        self.wfile.write(text.encode())

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            self.arrivals.append(self.waiting[0] + max(0, self.running[0] + 1 - self.BATCH))
            self.waiting[0] += 1
            self.lock.wait_for(lambda: self.running[0] < self.BATCH)
            self.waiting[0] -= 1
            self.running[0] += 1
        time.sleep(0.1)
        with self.lock:
            self.running[0] -= 1
            self.lock.notify_all()
        answer_json(self, 200, b'{"ok": true}')


@pytest.mark.parametrize("metrics", [True, False])
def test_requests_in_flight_follow_what_the_server_batches(metrics):
    """With vLLM's /metrics, the window falls to what the server runs once it queues: past the first burst (the
    cap, 48, below the window's start, and those sent as others finish before the first read of /metrics, POLL s
    in), no request arrives to find more than twice the batch waiting (the window probes one doubling above it);
    without /metrics, the cap is in flight, 44 of them queued at the server."""
    from evalkit.engine.served.concurrency import POLL
    from evalkit.engine.served.http import Client

    Batching.metrics, Batching.arrivals[:] = metrics, []
    with running(Batching, queue=256) as url:
        client = Client(f"{url}/v1", api_key=None, max_concurrency=48, timeout=60, retries=0)
        assert client.post_many("/completions", [{"n": i} for i in range(144)]) == [{"ok": True}] * 144
    burst = 48 + (round(POLL / 0.1) + 1) * Batching.BATCH  # 4 finish every 0.1 s; one step more for the read's trip
    queued_late = max(Batching.arrivals[burst:])
    if metrics:
        assert queued_late <= 2 * Batching.BATCH, Batching.arrivals
    else:
        assert client.peak_in_flight == 48 and max(Batching.arrivals) == 48 - Batching.BATCH, Batching.arrivals


def test_batches_share_one_tls_context(monkeypatch):
    """httpx builds a TLS context (the CA file loaded: about 20 ms of CPU, taken from a local server's cores) for
    each client it opens, http:// or not; the served client's batches, their /metrics reads and their /health
    checks (every 0.05 s here) share one, built at most once in the process."""
    import ssl

    from evalkit.engine.served.http import Client

    built, real = [], ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or real(*a, **k))
    Batching.metrics, Batching.arrivals[:] = True, []
    with running(Batching, queue=64) as url:
        client = Client(f"{url}/v1", api_key=None, max_concurrency=8, timeout=60, retries=0, health_poll=0.05)
        for _ in range(2):  # 24 requests, 4 at a time for 0.1 s each: the window is full when the tuner looks
            assert client.post_many("/completions", [{"n": i} for i in range(24)]) == [{"ok": True}] * 24
    assert len(built) <= 1


def test_the_window_doubles_while_full_and_falls_to_what_the_server_runs():
    from evalkit.engine.served.concurrency import START, Window, server_load

    window = Window(cap=256)
    assert window.limit == START
    window.seen(running=START, waiting=0, in_flight=START)
    assert window.limit == 2 * START
    window.seen(running=20, waiting=0, in_flight=20)  # not full: stays
    window.seen(running=0, waiting=0, in_flight=2 * START)  # full, but the server has not seen them yet: stays
    assert window.limit == 2 * START
    window.seen(running=24, waiting=9, in_flight=33)
    assert window.limit == 24
    for _ in range(8):
        window.seen(running=window.limit, waiting=0, in_flight=window.limit)
    assert window.limit == 256
    window = Window(cap=8)
    assert window.limit == 8
    page = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="a b"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\nvllm:num_requests_running{engine="1"} 2.0\n')
    assert server_load(page) == (5, 1) and server_load("up 1\n") is None


def test_chains_are_sent_only_where_they_cost_the_server_less():
    """Choices of several tokens behind a short question are read whole (fewer requests); behind a long few-shot
    context, or of one token each, they are chained (the context prefilled once)."""
    from evalkit.contracts import ScoreRequest
    from evalkit.engine.served.body import chaining_pays

    def question(context_len: int, choice_len: int, first: int) -> list:
        context = tuple(range(first, first + context_len))
        return [ScoreRequest(ids=context + tuple(range(9000 + 10 * c, 9000 + 10 * c + choice_len)), start=context_len)
                for c in range(4)]

    digits = [r for q in range(30) for r in question(15, 5, 100 * q)]  # evalkit_bench_num_mc's shape
    assert not chaining_pays(digits)
    assert chaining_pays([r for q in range(30) for r in question(15, 1, 100 * q)])  # one-token choices
    assert chaining_pays([r for q in range(30) for r in question(250, 5, 1000 * q)])  # behind a few-shot context


@pytest.mark.engine
def test_multi_token_choices_behind_a_long_context_chain_and_score_as_read_whole(served):
    """Three-token choices behind a ~150-token context are chained (chaining_pays) and score as their prompt
    log-probabilities do (fast=False)."""
    from evalkit.contracts import ScoreRequest

    context = tuple(served.encode("Question: what comes next? " * 20 + "\nAnswer:", True))
    choices = [served.encode(text, False) for text in (" one two three", " four five six", " seven eight nine")]
    requests = [ScoreRequest(ids=context + tuple(c), start=len(context)) for c in choices]
    before = served.scoring_counts().get("chained", 0)
    fast = served.score(requests, fast=True)
    assert served.scoring_counts()["chained"] - before == len(requests)
    plain = served.score(requests, fast=False)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(fast, plain)) <= 1e-4
    assert [s.is_greedy for s in fast] == [s.is_greedy for s in plain]
