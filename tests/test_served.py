"""engine=served against one real vLLM OpenAI server of the embedded model, started by evalkit itself
(endpoint.serve=true) once for the module: the probe, the answers against the offline engine, a whole run,
faults injected by a proxy between evalkit and the server, and the server's process group stopped on close.
The parts that need no server: tests/test_served_units.py.
Run: pytest -m engine tests/test_served.py
"""

import json
import os
import time

import pytest

from evalkit.config import compose_config
from evalkit.contracts import GenRequest, ScoreRequest
from tests.conftest import EAGER, PARITY_TASKS


# --- against one real vLLM server, started by evalkit (endpoint.serve=true) ---

@pytest.fixture(scope="module")
def served(embedded_model_dir, tmp_path_factory):
    from evalkit.engine.factory import start_engines

    started = time.monotonic()
    cfg = compose_config(["engine=served", "endpoint.serve=true", "gpu_memory_utilization=0.15", EAGER,
                          f"output_dir={tmp_path_factory.mktemp('served')}"])
    engine = start_engines(cfg, embedded_model_dir)
    print(f"served fixture: {time.monotonic() - started:.0f}s to start and probe")
    yield engine
    engine.close()


PROMPTS = ["The capital of France is", "2 + 3 =", "Question: What color is the sky?\nAnswer:", "Once upon a time"]


@pytest.mark.engine
def test_the_probe_passes_and_describe_names_the_deployment(served):
    described = served.describe()
    assert described["deployment"]["max_model_len"] == 4096 and described["deployment"]["version"] == "0.32.0"
    assert described["probe"]["tokenize"] is True and described["probe"]["cache_salt"] == "verified"
    assert described["engine_args"]["started_by_evalkit"] and "@" not in described["engine_args"]["url"]
    # the server evalkit starts gets the settings an offline engine would (the tests bind the cores themselves)
    assert [c["setting"] for c in described["choices"]] == ["engine_kwargs.block_size",
                                                             "engine_kwargs.kv_cache_memory_bytes"]


@pytest.mark.engine
def test_served_answers_are_the_offline_engines(served, engine):
    gens = [GenRequest(prompt_ids=tuple(engine.encode(p, True)), max_tokens=12, stop=("\n",),
                       sampling=(("temperature", 0.0),)) for p in PROMPTS]
    assert served.generate(gens) == engine.generate(gens)
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
    assert served.scoring_counts()["single_token"] == len(PROMPTS) and served.scoring_counts()["mismatched"] == 0


@pytest.fixture(scope="module")
def runs(served, engine, tmp_path_factory):
    """The embedded tasks on 5 documents each: on the offline engine, and on the server."""
    from evalkit.engine.wrapper import Lent
    from evalkit.run.evaluate import evaluate

    tmp = tmp_path_factory.mktemp("runs")
    args = ["tasks=[evalkit_arith,evalkit_facts,parity_rolling]", f"tasks_dirs=[{PARITY_TASKS}]", "limit=5",
            "gpu_memory_utilization=0.25", EAGER]  # parity_rolling: perplexity, rolling windows
    offline = evaluate(compose_config([*args, f"output_dir={tmp / 'offline'}"]),
                       engine_factory=lambda c, d: Lent(engine))
    online = evaluate(compose_config([*args, f"output_dir={tmp / 'served'}", "engine=served",
                                      f"endpoint.url={served.client.url}"]), engine_factory=lambda c, d: Lent(served))
    return offline, online


@pytest.mark.engine
def test_a_served_run_gives_the_offline_runs_samples(runs):
    from evalkit.run.results import read_samples

    offline, online = runs
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
def test_locate_traces_a_served_run_through_its_server(runs, tmp_path):
    """A copy of the served run whose first generation starts with another token: --locate starts the run's
    engine from its results.json (engine=served, the same server), traces both outputs there and finds the
    flip at that token, the server's own token ahead."""
    import shutil

    from evalkit.compare.locate import locate

    _, online = runs
    edited = tmp_path / online.name
    shutil.copytree(online, edited)
    (path,) = edited.glob("samples_evalkit_arith_*.jsonl")
    samples = [json.loads(line) for line in path.read_text().splitlines()]
    record = next(r for r in samples[0]["requests"] if r["kind"] == "generate_until")
    served_token = record["output_ids"][0]
    record["output_ids"] = [served_token + 1, *record["output_ids"][1:]]
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    (located,) = locate(online, [edited])
    assert "served" in located.engines["reference"] and "same settings" in located.engines["candidate"]
    (flip,) = located.flips
    assert (flip.doc_id, flip.index, flip.ref_token, flip.cand_token) == \
        (samples[0]["doc_id"], 0, served_token, served_token + 1), flip
    assert flip.ref_side.ref_logprob > flip.ref_side.cand_logprob  # the server prefers its own token
    assert flip.drift == 0.0  # one engine, both sides: the same numbers


@pytest.fixture
def proxy(served):
    from tests.fault_proxy import FaultProxy

    spoiler = FaultProxy(served.client.root())
    yield spoiler
    spoiler.close()


def through(proxy, embedded_model_dir, *overrides):
    """evalkit's served engine for the module's server, reached through the proxy (probed through it too)."""
    from evalkit.engine.factory import start_engines

    cfg = compose_config(["engine=served", f"endpoint.url={proxy.url}", "endpoint.timeout=4", *overrides])
    return start_engines(cfg, embedded_model_dir)


def score_requests(engine):
    requests = []
    for p in PROMPTS:
        ids = tuple(engine.encode(p, True))
        requests += [ScoreRequest(ids=ids, start=1), ScoreRequest(ids=ids, start=len(ids) - 1)]
    return requests


@pytest.mark.engine
def test_faults_on_the_way_are_retried_and_the_answers_are_the_servers(served, proxy, embedded_model_dir):
    """429, 500, a hang past the timeout, a dropped connection, a body cut short and an answer with the wrong
    prompt ids, one each on the first requests: every answer is still the server's own."""
    from tests.fault_proxy import FAULTS

    engine = through(proxy, embedded_model_dir, "endpoint.retries=3")
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
    from evalkit.engine.served import ServedError

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
    from evalkit.engine.served import ServedError

    args = ["engine=served", f"endpoint.url={proxy.url}", "endpoint.retries=1", "endpoint.timeout=4",
            "tasks=[evalkit_arith]", "limit=10", "chunk_size=2", f"output_dir={tmp_path}"]
    proxy.die_after = 2 + 6  # the probe's two completions, then six answers
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


def without_prompt_logprobs(answer: dict) -> dict:
    """The answer of a server that is not vLLM: it ignores prompt_logprobs and return_token_ids."""
    for choice in answer["choices"]:
        for key in ("prompt_logprobs", "prompt_token_ids", "token_ids"):
            choice.pop(key, None)
    return answer


@pytest.mark.engine
def test_a_server_that_cannot_be_evaluated_is_refused_in_one_line_and_nothing_is_written(proxy, tmp_path):
    import subprocess
    import sys

    from evalkit.config import ConfigError
    from evalkit.run.evaluate import evaluate

    url = f"endpoint.url={proxy.url}"
    cases = [([url, "endpoint.model=no-such-model"], "endpoint.model=no-such-model is not served at"),
             ([url, "max_model_len=8192"], "the server's max_model_len is 4096, less than max_model_len=8192"),
             ([url], "the server failed evalkit's probe: ")]
    for i, (overrides, message) in enumerate(cases):
        proxy.rewrite = without_prompt_logprobs if i == 2 else None
        out = tmp_path / str(i)
        with pytest.raises(ConfigError, match=message) as error:
            evaluate(compose_config(["engine=served", *overrides, f"output_dir={out}"]))
        assert "\n" not in str(error.value) and not out.exists()
    out = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "evalkit", "engine=served", "endpoint.url=http://127.0.0.1:9/v1",
                           "endpoint.retries=0", f"output_dir={out}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and not out.exists()
    assert done.stderr.strip().splitlines() == ["evalkit: error: the server at http://127.0.0.1:9/v1 did not answer "
                                                "/v1/models: ConnectError: All connection attempts failed"]


@pytest.mark.engine
def test_close_stops_the_whole_server_group(served):
    group = served.server.process.pid
    served.close()
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)


@pytest.mark.engine
def test_no_server_process_is_left_after_sigkill_of_evalkit(tmp_path):
    """python -m evalkit with endpoint.serve=true, killed by SIGKILL once its server answers: the try dies with
    its supervisor (the watchdog), the server's guard with the try (PR_SET_PDEATHSIG), and the guard takes the
    server's whole process group (API server, engine core, worker) with it."""
    import re
    import signal
    import subprocess
    import sys

    import psutil

    log = tmp_path / "log"
    with open(log, "w") as out:
        run = subprocess.Popen([sys.executable, "-m", "evalkit", "engine=served", "endpoint.serve=true", "limit=40",
                                "gpu_memory_utilization=0.15", EAGER, f"output_dir={tmp_path / 'result'}"],
                               stdout=out, stderr=out)
    deadline = time.monotonic() + 600
    while not re.search(r"evalkit: engine=served: ", log.read_text()):
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    guards = [p for p in psutil.process_iter(["cmdline"])
              if "evalkit.engine.served_start" in " ".join(p.info["cmdline"] or []) and "GUARD" in p.info["cmdline"]]
    (guard,) = guards
    group = os.getpgid(guard.pid)
    def in_group(proc) -> bool:
        try:
            return os.getpgid(proc.pid) == group
        except ProcessLookupError:
            return False

    assert sum(map(in_group, psutil.process_iter())) >= 3  # the guard, the API server, the engine core
    run.send_signal(signal.SIGKILL)
    run.wait()
    killed = time.monotonic()
    while time.monotonic() - killed < 30:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the server's group {group} is still alive 30 s after SIGKILL of evalkit")
    print(f"\nSIGKILL of evalkit with endpoint.serve=true: the server's group gone after {time.monotonic() - killed:.1f} s")
