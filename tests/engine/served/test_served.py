"""engine=served against the session's real vLLM OpenAI server of the embedded model, started by evalkit itself
(endpoint.serve=true; tests/conftest.py ``served``): the probe, the answers against the offline engine, a whole
run, --locate through the server, and faults injected by a proxy between evalkit and the server. Servers that
cannot be evaluated as vLLM, Ctrl-C and kill -9: tests/engine/served/test_served_deployments.py. The parts that need no
server: tests/engine/served/test_served_units.py and tests/engine/served/test_served_openai.py.
Run: pytest -m engine tests/engine/served/test_served.py
"""

import json

import pytest

from evalkit.config import compose_config
from evalkit.contracts import GenRequest, ScoreRequest
from evalkit.engine.wrapper import KeptRunning
from tests.conftest import DEPLOYMENT, PROMPTS, SERVER_KEY, score_requests, through


@pytest.mark.engine
def test_the_probe_passes_and_describe_names_the_deployment(served):
    """The deployment as the server names it (the vLLM installed here, which serves it); the probe finds the
    server answers given ids exactly where its completions API has the field (vLLM 0.32; not 0.23)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from evalkit.versions import installed

    described = served.describe()
    assert described["deployment"]["max_model_len"] == 4096
    assert described["deployment"]["version"].split("+")[0] == installed()["vllm"].split("+")[0]
    assert described["probe"]["tokenize"] is True and described["probe"]["logprob_token_ids"] is \
        ("logprob_token_ids" in CompletionRequest.model_fields)
    # the salt checked where the server counts cached tokens in every answer (0.32); 0.23's leaves a 0 out
    assert described["probe"]["cache_salt"] == "verified" or described["probe"]["cached_tokens"] == [None, None]
    assert described["engine_args"]["started_by_evalkit"] and "@" not in described["engine_args"]["url"]
    # the server evalkit starts gets the settings an offline engine would (the tests bind the cores themselves)
    assert [c["setting"] for c in described["choices"]] == ["engine_kwargs.block_size",
                                                             "engine_kwargs.kv_cache_memory_bytes"]


@pytest.mark.engine
def test_the_server_evalkit_started_answers_only_its_key_which_no_command_line_shows(served):
    """Another user of the machine reaches the port but not the server: a request without the run's key, or with
    another, is refused (401); the key is in the server's environment, on no process's command line."""
    import urllib.error
    import urllib.request

    import psutil

    def status(key):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(served.client.url + "/models", headers=headers),
                                        timeout=30) as answer:
                return answer.status
        except urllib.error.HTTPError as error:
            return error.code

    assert (status(None), status("guessed"), status(served.server.api_key)) == (401, 401, 200)
    group = [p for p in psutil.process_iter() if _group(p.pid) == served.server.process.pid]
    assert group and not any(served.server.api_key in " ".join(p.cmdline()) for p in group)


def app_routes(command):
    """Every (method, path) and websocket path of the app vLLM builds from the server's command line (vLLM's own
    build_app and argument parser), with every task vLLM knows, so no route of another task is missed."""
    import typing

    from fastapi.routing import APIWebSocketRoute
    from starlette.routing import Mount
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.tasks import SupportedTask
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def leaves(kind):
        return [leaf for arg in typing.get_args(kind) for leaf in (leaves(arg) if typing.get_args(arg) else [arg])]

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(command)
    app = build_app(args, tuple(leaves(SupportedTask)), None)
    http, sockets = [], []
    for route in app.routes:
        path = route.path.replace("{", "").replace("}", "")  # a path parameter given its own name as value
        if isinstance(route, APIWebSocketRoute):
            sockets.append(path)
        else:
            methods = ["GET", "POST"] if isinstance(route, Mount) else sorted(route.methods)  # a mounted app: any
            http += [(method, where) for method in methods
                     for where in ([path, path + "/"] if isinstance(route, Mount) else [path])]
    return http, sockets


@pytest.mark.engine
def test_every_route_of_the_server_evalkit_started_refuses_a_request_without_its_key(served):
    """vLLM checks its key only under /v1, /v2, /inference and /cohere; the server evalkit starts answers nothing
    without the run's key: each route of the app vLLM builds from the server's own command line (SageMaker's
    /invocations, /tokenize, /metrics, /health, the docs, a websocket, ...) and a path no route has answer 401
    without a key and with another key (a websocket is refused before it opens); with the key, /tokenize and
    /health answer."""
    import http.client

    import psutil

    server = [p for p in psutil.process_iter(["pid", "cmdline"]) if _group(p.pid) == served.server.process.pid
              and "vllm.entrypoints.openai.api_server" in p.info["cmdline"]][0]
    command = server.info["cmdline"]
    routes, sockets = app_routes(command[command.index("vllm.entrypoints.openai.api_server") + 1:])
    assert ("POST", "/invocations") in routes and ("GET", "/metrics") in routes and sockets, (routes, sockets)

    def status(method, path, key, headers=()):
        connection = http.client.HTTPConnection("127.0.0.1", served.server.port, timeout=60)
        try:
            given = dict(headers, **({"Authorization": f"Bearer {key}"} if key else {}))
            body = json.dumps({"model": served.model, "prompt": "a"}) if method in ("POST", "PUT", "PATCH") else None
            connection.request(method, path, body=body, headers={"Content-Type": "application/json", **given})
            return connection.getresponse().status
        finally:
            connection.close()

    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    answered = {(method, path, key): status(method, path, key) for method, path in [*routes, ("GET", "/no-route")]
                for key in (None, "guessed")}
    opened = {(path, key): status("GET", path, key, upgrade) for path in sockets for key in (None, "guessed")}
    assert {where: code for where, code in answered.items() if code != 401} == {}
    assert {where: code for where, code in opened.items() if code != 403} == {}  # closed before it opened
    key = served.server.api_key
    assert (status("GET", "/health", key), status("POST", "/tokenize", key)) == (200, 200)


def _group(pid):
    import os

    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.mark.engine
def test_served_answers_are_the_offline_engines(served, engine):
    gens = [GenRequest(prompt_ids=tuple(engine.encode(p, True)), max_tokens=12, stop=("\n",),
                       sampling=(("temperature", 0.0),)) for p in PROMPTS]
    sent_before = served.scoring_counts().get("http_requests", 0)
    assert served.generate(gens) == engine.generate(gens)
    assert served.scoring_counts()["http_requests"] - sent_before == 1  # the four prompts in one request
    scores = []
    for p in PROMPTS:
        ids = tuple(engine.encode(p, True))
        scores += [ScoreRequest(ids=ids, start=1), ScoreRequest(ids=ids, start=len(ids) - 1),
                   ScoreRequest(ids=ids, start=len(ids) - 3)]
    for fast in (True, False):
        ours, theirs = served.score(scores, fast=fast), engine.score(scores, fast=fast)
        assert [s.is_greedy for s in ours] == [s.is_greedy for s in theirs]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(ours, theirs)) <= 1e-4
    for a, b in zip(served.trace(scores[:3], 3), engine.trace(scores[:3], 3)):
        assert [t for t, _ in a.top[-1]] == [t for t, _ in b.top[-1]]
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4
    counts = served.scoring_counts()  # fast: chained, their reads bundled (chaining_pays); else each read whole
    whole = len(scores) if served.probed["logprob_token_ids"] else 2 * len(scores)  # no chains without given ids
    assert (counts["prompt_logprobs"], counts["mismatched"]) == (whole, 0)


@pytest.mark.engine
def test_traces_come_in_the_requests_that_answer_and_agree_with_the_offline_engine_and_a_second_pass(served, engine):
    """top_k > 0 (divergence_top_k): the greedy generations' steps come back with them (logprobs=k, one request
    for the four prompts), the scores' traces with the scores; equal to the offline engine's one pass and to the
    server's own second-pass trace of the same tokens."""
    gens = [GenRequest(prompt_ids=tuple(engine.encode(p, True)), max_tokens=12, stop=("\n",),
                       sampling=(("temperature", 0.0),)) for p in PROMPTS]
    sent_before = served.scoring_counts().get("http_requests", 0)
    ours, theirs = served.generate(gens, top_k=5), engine.generate(gens, top_k=5)
    assert served.scoring_counts()["http_requests"] - sent_before == 1
    apart = served.trace([ScoreRequest(ids=r.prompt_ids + g.token_ids, start=len(r.prompt_ids))
                          for r, g in zip(gens, ours)], 5)
    for mine, offline, prefill in zip(ours, theirs, apart):
        assert mine.token_ids == offline.token_ids and len(mine.trace.logprobs) == mine.output_tokens > 0
        for other in (offline.trace, prefill):
            assert [[t for t, _ in top] for top in mine.trace.top] == [[t for t, _ in top] for top in other.top]
            assert max(abs(x - y) for x, y in zip(mine.trace.logprobs, other.logprobs)) <= 1e-4
    scores = score_requests(engine)
    scored, traced = served.score(scores, top_k=5), served.trace(scores, 5)
    assert [s.trace.top for s in scored] == [t.top for t in traced]
    assert all(abs(sum(s.trace.logprobs) - s.logprob) <= 1e-9 for s in scored)
    assert all(s.trace is None for s in served.score(scores)) and all(g.trace is None for g in served.generate(gens))


def id_reads_of_traces(engine, traces_of, k: int = 20, seed: int = 0):
    """At each position of PROMPTS' traces (traces_of(requests, k)): a read of 8 of its top ids in shuffled order
    and 12 ids outside them; with the values those 8 have in the trace, and the trace's last top value."""
    import random

    from evalkit.contracts import IdsRead

    rng = random.Random(seed)
    requests = [ScoreRequest(ids=tuple(engine.encode(p, True)), start=1) for p in PROMPTS]
    reads, expected, lowest = [], [], []
    for r, trace in zip(requests, traces_of(requests, k)):
        for p, top in zip(range(1, len(r.ids)), trace.top):
            chosen = rng.sample(top, 8)
            others = rng.sample([t for t in range(1000, 5000) if t not in dict(top)], 12)
            reads.append(IdsRead(context=r.ids[:p], ids=(*(t for t, _ in chosen), *others)))
            expected.append([v for _, v in chosen])
            lowest.append(top[-1][1])
    return reads, expected, lowest


@pytest.mark.engine
def test_read_ids_through_vllms_api_gives_the_traces_values_in_the_order_asked(served, engine):
    """Engine.read_ids on the server: a trace's top ids read in another order give its values in that order, ids
    outside it read below its 20th; the reads' bodies bundled (16 a request, 128 ids at most); 300 ids in one
    read split into three bodies and merged, equal to the offline engine's read; none asked: () unsent."""
    from evalkit.contracts import IdsRead

    reads, expected, lowest = id_reads_of_traces(engine, served.trace)
    big = IdsRead(context=reads[3].context, ids=tuple(range(299, -1, -1)))
    before = served.scoring_counts()
    values = served.read_ids([*reads, big, IdsRead(context=(1, 2), ids=())])
    counts = {k: v - before.get(k, 0) for k, v in served.scoring_counts().items()}
    # without logprob_token_ids (vLLM 0.23's server), one prompt-row body per distinct id
    bodies = len(reads) + 3 if served.probed["logprob_token_ids"] else sum(len(set(r.ids)) for r in reads) + 300
    assert counts["id_reads"] == len(reads) + 2 and counts["id_read_bodies"] == bodies
    assert len(reads) // 6 <= counts["http_requests"] < counts["id_read_bodies"] and counts["mismatched"] == 0
    for got, want, last in zip(values, expected, lowest):
        assert len(got) == 20 and list(got[:8]) == pytest.approx(want, abs=1e-4)
        assert max(got[8:]) <= last + 1e-4
    assert values[-1] == () and values[-2] == pytest.approx(engine.read_ids([big])[0], abs=1e-4)
    with pytest.raises(ValueError, match="after an empty context"):
        served.read_ids([IdsRead(context=(), ids=(5,))])


@pytest.mark.engine
def test_an_id_read_wrong_once_is_sent_again_and_wrong_twice_fails_alone(served, proxy, embedded_model_dir):
    from evalkit.engine.served.engine import ServedError

    engine = through(proxy, embedded_model_dir)
    reads = id_reads_of_traces(engine, served.trace, seed=1)[0][:5]
    direct = served.read_ids(reads)
    proxy.faults = ["wrong_ids"]  # the first prompt of the first request, once
    flat = lambda answers: [v for values in answers for v in values]  # noqa: E731
    assert flat(engine.read_ids(reads)) == pytest.approx(flat(direct), abs=1e-4)
    assert proxy.spoiled == ["wrong_ids"] and engine.scoring_counts()["mismatched"] == 1
    # the prompts that carry read 2: its context, or (without logprob_token_ids) its context and each asked id
    proxy.wrong_ids_for = {reads[2].context} if engine.probed["logprob_token_ids"] else \
        {(*reads[2].context, t) for t in reads[2].ids}
    with pytest.raises(ServedError, match=r"^1 of 5 requests failed: the answer failed its check twice") as error:
        engine.read_ids(reads)
    assert "\n" not in str(error.value) and error.value.answers[2] is None
    assert flat(a for i, a in enumerate(error.value.answers) if i != 2) == pytest.approx(flat(direct[:2] + direct[3:]),
                                                                                      abs=1e-4)


@pytest.mark.engine
def test_a_server_read_through_the_openai_api_alone_cannot_read_given_ids(proxy, embedded_model_dir):
    from evalkit.contracts import IdsRead
    from tests.fault_proxy import openai_only

    openai_only(proxy)
    engine = through(proxy, embedded_model_dir)
    assert engine.describe()["probe"]["api"] == "openai"
    with pytest.raises(NotImplementedError, match=r"^the server is read through the OpenAI API alone") as error:
        engine.read_ids([IdsRead(context=(1, 2), ids=()), IdsRead(context=(1, 2), ids=(5,))])
    assert "\n" not in str(error.value) and engine.read_ids([IdsRead(context=(1, 2), ids=())]) == [()]


class NoTraceCalls(KeptRunning):
    """The session's server, refusing a second pass: every trace must come with the answers."""

    def trace(self, requests, top_k=5):
        raise AssertionError(f"{len(requests)} traces asked apart")

    def describe(self):
        return {**self.engine.describe(), "server_log": None}  # the server's log stays for served_runs' run


@pytest.mark.engine
def test_a_server_evalkit_did_not_start_needs_a_deployment_id_to_keep_answers(served, tmp_path):
    """Through the CLI, the session's server reached by its URL without endpoint.deployment: one line naming
    endpoint.deployment, exit 2, nothing written."""
    import subprocess
    import sys

    url = served.client.url
    done = subprocess.run([sys.executable, "-m", "evalkit", "engine=served", f"endpoint.url={url}", SERVER_KEY,
                           f"output_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and not (tmp_path / "out").exists(), done.stderr[-3000:]
    said = [line for line in done.stderr.strip().splitlines() if not line.startswith("evalkit: untested versions:")]
    assert said == [
        f"evalkit: error: the server at {url} cannot say which weights it serves (vLLM's system_fingerprint hashes "
        "its configuration, not its weights): pass endpoint.deployment=ID, an id that changes when the deployed "
        "weights do (their hash, a release tag), so its answers are kept under it; or resume=false to keep none"]


@pytest.mark.engine
def test_a_served_run_records_its_divergence_from_the_answers_alone(served, tmp_path):
    from evalkit.run.evaluate import evaluate

    cfg = compose_config(["tasks=[evalkit_arith,evalkit_facts]", "limit=3", "divergence_top_k=20", "resume=false",
                          "engine=served", f"endpoint.url={served.client.url}", DEPLOYMENT, f"output_dir={tmp_path}"])
    run_dir = evaluate(cfg, engine_factory=lambda c, d: NoTraceCalls(served))
    divergence = json.loads((run_dir / "results.json").read_text())["evalkit"]["divergence"]
    assert divergence["top_k"] == 20 and divergence["positions"]["evalkit_arith"] > 0
    assert divergence["positions"]["evalkit_facts"] > 0
    assert divergence["traced_apart"] == {"generate_until": 0, "loglikelihood": 0}, divergence
    assert divergence["max_score_gap"]["loglikelihood"] <= 1e-9


@pytest.mark.engine
def test_a_served_run_gives_the_offline_runs_samples(served_runs):
    from evalkit.run.results import read_samples

    offline, online = served_runs
    assert json.loads((online / "results.json").read_text())["evalkit"]["engine"]["name"] == "served"
    assert (online / "server.log").is_file()
    for task in ("evalkit_arith", "evalkit_facts", "parity_rolling"):
        ours, theirs = read_samples(online, task), read_samples(offline, task)
        assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs] and len(ours) == 5
        for a, b in zip(ours, theirs):
            for x, y in zip(a["resps"], b["resps"]):
                if isinstance(x[0], str):
                    assert x == y
                elif isinstance(x[0], float):  # a rolling log-likelihood: a document's sum over its windows
                    assert abs(x[0] - y[0]) <= 1e-3, (x, y)
                else:
                    assert abs(float(x[0][0]) - float(y[0][0])) <= 1e-4 and x[0][1] == y[0][1]
    # the deployment against the reference, as a user compares them: like for like, no row worse or changed
    import subprocess
    import sys

    compared = subprocess.run([sys.executable, "-m", "evalkit.compare", str(offline), str(online)],
                              capture_output=True, text=True, timeout=300)
    assert compared.returncode == 0, compared.stdout[-2000:] + compared.stderr[-2000:]
    assert "evalkit_arith" in compared.stdout and "evalkit_facts" in compared.stdout


@pytest.mark.engine
def test_a_served_run_gated_against_the_offline_run_evaluates_in_looks_and_is_not_worse(served_runs, served,
                                                                                       tmp_path):
    """gate.reference= on engine=served: the documents go to the server in the gate's seeded order, two of each
    task a look, and the verdict against the offline run on the same documents is `not worse` (the server's
    answers are the offline engine's), every document evaluated, the record in results.json."""
    from evalkit.run.evaluate import evaluate
    from tests.conftest import EAGER, PARITY_TASKS

    offline, _ = served_runs
    cfg = compose_config(["tasks=[evalkit_arith,evalkit_facts,parity_rolling]", f"tasks_dirs=[{PARITY_TASKS}]",
                          "limit=5", "gpu_memory_utilization=0.25", EAGER, f"output_dir={tmp_path}", "engine=served",
                          f"endpoint.url={served.client.url}", DEPLOYMENT, f"gate.reference={offline}",
                          "gate.chunk=2"])
    run_dir = evaluate(cfg, engine_factory=lambda c, d: KeptRunning(served))
    record = json.loads((run_dir / "results.json").read_text())["evalkit"]["gate"]
    assert record["verdict"] == "not worse" and not record["stopped_early"] and record["exit_code"] == 0, record
    assert [look["documents"]["evalkit_arith"] for look in record["looks"]] == [2, 4, 5]
    assert record["documents"] == {"evalkit_arith": 5, "evalkit_facts": 5, "parity_rolling": 5}


@pytest.mark.engine
def test_locate_traces_a_served_run_through_its_server(served, served_runs, tmp_path):
    """A copy of the served run whose first generation starts with another token: --locate, given the server as
    a user passes it (--ref-engine/--cand-engine engine=served endpoint.url=...: a run folder's recorded server
    is never taken, docs/security.md), traces both outputs there and finds the flip at that token, the server's
    own token ahead."""
    import shutil

    from evalkit.compare.locate import locate

    _, online = served_runs
    edited = tmp_path / online.name
    shutil.copytree(online, edited)
    (path,) = edited.glob("samples_evalkit_arith_*.jsonl")
    samples = [json.loads(line) for line in path.read_text().splitlines()]
    record = next(r for r in samples[0]["requests"] if r["kind"] == "generate_until")
    served_token = record["output_ids"][0]
    record["output_ids"] = [served_token + 1, *record["output_ids"][1:]]
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    trusted = ["engine=served", f"endpoint.url={served.client.url}", DEPLOYMENT, SERVER_KEY]
    (located,) = locate(online, [edited], ref_overrides=trusted, cand_overrides=trusted)
    assert "served" in located.engines["reference"] and "same settings" in located.engines["candidate"]
    (flip,) = located.flips
    assert (flip.doc_id, flip.index, flip.ref_token, flip.cand_token) == \
        (samples[0]["doc_id"], 0, served_token, served_token + 1), flip
    assert flip.ref_side.ref_logprob > flip.ref_side.cand_logprob  # the server prefers its own token
    assert flip.drift == 0.0  # one engine, both sides: the same numbers


@pytest.mark.engine
def test_faults_on_the_way_are_retried_and_the_answers_are_the_servers(served, proxy, embedded_model_dir):
    """429, 500, a hang past the timeout, a dropped connection, a body cut short and an answer with the wrong
    prompt ids, one each on the first tries of a batch's request (its prompts bundled in one): every answer is
    still the server's own."""
    from tests.fault_proxy import FAULTS

    # the batch's prompts go in one request (a bundle), so the faults come one after another on it: six tries
    engine = through(proxy, embedded_model_dir, "endpoint.retries=6")
    engine.client.backoff = 0.05  # a test's patience: the retries are what is tested, not their pace
    gens = [GenRequest(prompt_ids=tuple(engine.encode(p, True)), max_tokens=12, stop=("\n",),
                       sampling=(("temperature", 0.0),)) for p in PROMPTS]
    scores = score_requests(engine)
    direct = served.generate(gens), served.score(scores, fast=False)
    for kind, send in (("generate", lambda: engine.generate(gens)), ("score", lambda: engine.score(scores, fast=False))):
        proxy.faults = list(FAULTS)
        answers = send()
        assert sorted(proxy.spoiled) == sorted(FAULTS), (kind, proxy.spoiled)
        proxy.spoiled.clear()
        if kind == "generate":
            assert answers == direct[0]
        else:
            assert [s.is_greedy for s in answers] == [s.is_greedy for s in direct[1]]
            assert max(abs(a.logprob - b.logprob) for a, b in zip(answers, direct[1])) <= 1e-4
    assert engine.scoring_counts()["mismatched"] == 2  # each batch's answer with the wrong ids, sent again


@pytest.mark.engine
def test_an_answer_wrong_twice_fails_its_request_alone(served, proxy, embedded_model_dir):
    from evalkit.engine.served.engine import ServedError

    engine = through(proxy, embedded_model_dir)
    scores = score_requests(engine)
    proxy.wrong_ids_for = {scores[2].ids}
    with pytest.raises(ServedError) as error:
        engine.score(scores, fast=False)
    assert str(error.value).startswith(f"2 of {len(scores)} requests failed: the answer failed its check twice")
    assert "\n" not in str(error.value)
    direct = served.score(scores, fast=False)
    for i, (answer, reference) in enumerate(zip(error.value.answers, direct)):
        if scores[i].ids == scores[2].ids:
            assert answer is None  # never scored
        else:
            assert answer.is_greedy == reference.is_greedy and abs(answer.logprob - reference.logprob) <= 1e-4


@pytest.mark.engine
def test_a_server_killed_mid_run_then_back_computes_only_what_is_missing(served, proxy, tmp_path):
    """The server dies (behind the proxy) after 6 answers: the run fails in one line and keeps them; the same
    command once the server is back sends only the rest, and the samples equal an uninterrupted run's."""
    from evalkit.run.evaluate import evaluate
    from evalkit.run.results import read_samples
    from evalkit.engine.served.engine import ServedError

    args = ["engine=served", f"endpoint.url={proxy.url}", DEPLOYMENT, "endpoint.retries=1", "endpoint.timeout=4",
            "tasks=[evalkit_arith]", "limit=10", "chunk_size=2", f"output_dir={tmp_path}"]
    proxy.die_after = 3 + 3  # the probe's three completions, then three answers of two prompts (one request a chunk)
    with pytest.raises(ServedError, match=r"^\d+ of \d+ requests failed: RemoteProtocolError"):
        evaluate(compose_config(args))
    stored = sum(len(f.read_text().splitlines())
                 for f in (tmp_path / "smollm2-135m-instruct" / ".requests").glob("*.jsonl"))
    assert stored >= 6
    proxy.die_after, proxy.dead = None, False
    run_dir = evaluate(compose_config(args))
    resume = json.loads((run_dir / "results.json").read_text())["evalkit"]["resume"]
    assert resume["reused"] >= stored and resume["computed"] <= 10 - stored, resume
    clean = evaluate(compose_config([*args[:-1], f"output_dir={tmp_path / 'clean'}", "resume=false"]))
    assert [s["resps"] for s in read_samples(run_dir, "evalkit_arith")] == \
        [s["resps"] for s in read_samples(clean, "evalkit_arith")]
