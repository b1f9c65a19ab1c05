"""engine=served against servers that are not what the offline engine is: the session's real vLLM server
(tests/conftest.py ``served``) refused when it cannot be evaluated as configured, made by a proxy to ignore
vLLM's fields as other servers do (read through echo), stopped mid-run by Ctrl-C, answering as another
deployment mid-run (its system_fingerprint), shut down by SIGTERM mid-run (a server of the run's own), and
evalkit killed by SIGKILL with a server of its own. The last test here closes the session's server.
Run: pytest -m engine tests/engine/served/test_served_deployments.py
"""

import json
import os
import time

import pytest

from evalkit.config import compose_config
from evalkit.contracts import GenRequest
from tests.conftest import DEPLOYMENT, EAGER, PROMPTS, SERVED_TASKS, SERVER_KEY, score_requests, through


@pytest.mark.engine
def test_a_server_that_cannot_be_evaluated_is_refused_in_one_line_and_nothing_is_written(proxy, tmp_path):
    import subprocess
    import sys

    from evalkit.config import ConfigError
    from evalkit.run.evaluate import evaluate

    url = f"endpoint.url={proxy.url}"
    cases = [([url, "endpoint.model=no-such-model"], "endpoint.model=no-such-model is not served at"),
             ([url, "max_model_len=8192"], "the server's max_model_len is 4096, less than max_model_len=8192"),
             ([url], r"the server failed evalkit's probe: the server saw a \d+-token prompt, not the \d+ token ids sent")]
    for i, (overrides, message) in enumerate(cases):
        proxy.faults = ["wrong_ids"] if i == 2 else []  # the probe's first answer, with another prompt's ids
        out = tmp_path / str(i)
        with pytest.raises(ConfigError, match=message) as error:
            evaluate(compose_config(["engine=served", DEPLOYMENT, *overrides, f"output_dir={out}"]))
        assert "\n" not in str(error.value) and not out.exists()
    out = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "evalkit", "engine=served", "endpoint.url=http://127.0.0.1:9/v1",
                           DEPLOYMENT, "endpoint.retries=0", f"output_dir={out}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and not out.exists()
    assert done.stderr.strip().splitlines() == ["evalkit: error: the server at http://127.0.0.1:9 refused connections "
                                                "(ConnectError: All connection attempts failed)"]


@pytest.mark.engine
def test_a_server_without_vllms_fields_is_read_through_echo_and_agrees(served, proxy, embedded_model_dir):
    """The same server, made by the proxy to ignore vLLM's fields as a server that is not vLLM does: the probe
    finds it out, generations and log-likelihoods (by echo) are the server's own and equal vLLM's reads, with
    the output's token ids where it names tokens by id and without them where it writes them as text."""
    from tests.fault_proxy import openai_only

    gens = [GenRequest(prompt_ids=tuple(served.encode(p, True)), max_tokens=12, stop=("\n",),
                       sampling=(("temperature", 0.0),)) for p in PROMPTS]
    scores = score_requests(served)
    direct = served.generate(gens), served.score(scores, fast=False), served.trace(scores[:2], 3)
    for token_ids in (True, False):
        openai_only(proxy, token_ids=token_ids)
        engine = through(proxy, embedded_model_dir)
        probed = engine.describe()["probe"]
        assert (probed["api"], probed["scoring"], engine.deployment["version"]) == ("openai", "echo", None), probed
        assert engine.deployment["max_model_len"] is None and engine.deployment["api"] == "openai"
        generated = engine.generate(gens)
        if token_ids:
            assert generated == direct[0]
            assert [t.top[-1][0][0] for t in engine.trace(scores[:2], 3)] == [t.top[-1][0][0] for t in direct[2]]
        else:
            assert [(g.text, g.output_tokens) for g in generated] == [(g.text, g.output_tokens) for g in direct[0]]
            assert all(g.token_ids == () for g in generated) and probed["output_ids"].startswith("not returned")
        ours = engine.score(scores)
        assert [s.is_greedy for s in ours] == [s.is_greedy for s in direct[1]]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(ours, direct[1])) <= 1e-4
        counts = engine.scoring_counts()
        assert counts["echo"] == len(scores) and "single_token" not in counts and counts["mismatched"] == 0


@pytest.mark.engine
def test_a_server_whose_echo_misses_the_prompt_runs_generation_and_refuses_log_likelihoods(proxy, served_runs, tmp_path):
    """An echo whose log-probabilities cover the generated token only (as llama.cpp's did, and lm-eval scored
    chance): a log-likelihood task is refused in one line with nothing written; a generation task runs, and
    its samples are the offline run's."""
    import subprocess
    import sys

    from evalkit.run.evaluate import evaluate
    from evalkit.run.results import read_samples
    from tests.fault_proxy import openai_only

    openai_only(proxy, echo_covers_prompt=False)
    args = ["engine=served", f"endpoint.url={proxy.url}", DEPLOYMENT, "limit=5"]
    refused = tmp_path / "refused"
    done = subprocess.run([sys.executable, "-m", "evalkit", *args, "tasks=[evalkit_arith,evalkit_facts]",
                           f"output_dir={refused}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and not refused.exists(), done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr and line.startswith("evalkit: error: evalkit_facts need log-likelihoods, and the server's echo failed "
                           "evalkit's probe (the echo has 1 tokens"), line
    run = evaluate(compose_config([*args, "tasks=[evalkit_arith]", f"output_dir={tmp_path / 'ran'}"]))
    assert json.loads((run / "results.json").read_text())["evalkit"]["engine"]["probe"]["scoring"] is None
    offline, _ = served_runs
    assert [s["resps"] for s in read_samples(run, "evalkit_arith")] == \
        [s["resps"] for s in read_samples(offline, "evalkit_arith")]


def metric(url: str, name: str, key: str) -> float:
    """One of the server's Prometheus counters or gauges, summed over its labels (asked with the server's key:
    the server evalkit starts answers no path without it)."""
    import urllib.request

    asked = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(asked, timeout=10) as answer:
        lines = answer.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{") or line.startswith(name + " "))


@pytest.mark.engine
def test_ctrl_c_cancels_the_requests_in_flight_on_the_server(served, tmp_path):
    """Ctrl-C (SIGINT to evalkit's process group) while the server generates 5 answers of 1000 tokens: evalkit
    stops in one line with exit 130, and the server stops their work (it aborts a request whose client
    disconnected): none is left running or waiting, and it generates nothing more."""
    import signal
    import subprocess
    import sys

    root, key = served.client.root(), served.server.api_key
    before = metric(root, "vllm:generation_tokens_total", key)
    log = tmp_path / "log"
    with open(log, "w") as out:
        run = subprocess.Popen([sys.executable, "-m", "evalkit", "engine=served", f"endpoint.url={served.client.url}",
                                DEPLOYMENT, SERVER_KEY, "tasks=[served_long]", f"tasks_dirs=[{SERVED_TASKS}]",
                                "+sampling_kwargs={min_tokens: 1000, ignore_eos: true}", f"output_dir={tmp_path}"],
                               stdout=out, stderr=out, process_group=0)
    deadline = time.monotonic() + 300
    while metric(root, "vllm:num_requests_running", key) < 5:  # the task's 5 documents
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGINT)
    assert run.wait(timeout=120) == 130, log.read_text()[-3000:]
    assert "evalkit: error: stopped: by SIGINT; finished answers are kept" in log.read_text() and "Traceback" not in log.read_text(), log.read_text()[-3000:]
    while metric(root, "vllm:num_requests_running", key) + metric(root, "vllm:num_requests_waiting", key) > 0:
        assert time.monotonic() < deadline, "the server still works on evalkit's requests"
        time.sleep(0.2)
    stopped = metric(root, "vllm:generation_tokens_total", key)
    time.sleep(2)
    assert metric(root, "vllm:generation_tokens_total", key) == stopped < before + 5 * 1000


@pytest.mark.engine
def test_an_answer_from_another_deployment_fails_the_run_and_nothing_of_it_is_kept(proxy, tmp_path):
    """After the probe and three answers, the server's answers carry another system_fingerprint (a restart under
    other settings, a replica of another build behind a load balancer): the run fails in one line naming the
    change, and the store keeps the three answers of the probed deployment and nothing of the other."""
    import subprocess
    import sys
    import threading

    seen, lock = [0], threading.Lock()

    def another_after_three(answer: dict) -> dict:
        with lock:
            seen[0] += 1
            if seen[0] > 3 + 3:  # the probe's three completions, then three answers
                answer["system_fingerprint"] = "vllm-0.32.0-0badc0de"
        return answer

    proxy.rewrite = another_after_three
    done = subprocess.run([sys.executable, "-m", "evalkit", "engine=served", f"endpoint.url={proxy.url}", DEPLOYMENT,
                           "endpoint.max_concurrency=1", "tasks=[evalkit_arith]", "limit=8", f"output_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("evalkit: error: ServedError: 5 of 8 requests failed: the server's system_fingerprint "
                           "changed from vllm-") and "to vllm-0.32.0-0badc0de: another deployment answers at" in last, last
    assert "Traceback" not in done.stderr and "gpu_memory_utilization" not in done.stderr, done.stderr[-3000:]
    (store,) = (tmp_path / "smollm2-135m-instruct" / ".requests").glob("*.jsonl")
    assert len(store.read_text().splitlines()) == 3


@pytest.mark.engine
def test_a_server_shut_down_mid_run_fails_the_run_in_one_line_and_keeps_its_answers(tmp_path):
    """endpoint.serve=true, one 30-token generation at a time; once one is finished, SIGTERM to vLLM's API server
    (a rolling restart, a preempted pod): it aborts the request in flight and stops listening but keeps the open
    connection waiting. The run notices (its /health refused) and ends in one line about the server, with the
    finished answers kept, though endpoint.timeout is an hour."""
    import re
    import signal
    import subprocess
    import sys

    import psutil

    from evalkit.engine.served import start

    log = tmp_path / "log"
    with open(log, "w") as out:
        run = subprocess.Popen([sys.executable, "-m", "evalkit", "engine=served", "endpoint.serve=true",
                                "endpoint.max_concurrency=1", "endpoint.timeout=3600", "tasks=[served_long]",
                                f"tasks_dirs=[{SERVED_TASKS}]", "max_tokens=30",  # ~2 s each here
                                "+sampling_kwargs={min_tokens: 30, ignore_eos: true}", "gpu_memory_utilization=0.15",
                                EAGER, f"output_dir={tmp_path / 'result'}"], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 900
        while not (found := re.search(r"evalkit: engine=served: http://127.0.0.1:(\d+)/v1", log.read_text())):
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        root = f"http://127.0.0.1:{found.group(1)}"
        # the run's key, from the environment of the server listening there (this user may read it)
        server = next(pid for pid in start.listeners(int(found.group(1))) if pid is not None)
        key = psutil.Process(server).environ()["VLLM_API_KEY"]
        while metric(root, "vllm:request_success_total", key) < 3 + 1 or \
                metric(root, "vllm:num_requests_running", key) < 1:
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]  # the probe's 3, one
            time.sleep(0.5)
        (api,) = [p for p in psutil.Process(run.pid).children(recursive=True)  # the server, not its guard
                  if "vllm.entrypoints.openai.api_server" in p.cmdline() and "GUARD" not in p.cmdline()]
        api.send_signal(signal.SIGTERM)
        terminated = time.monotonic()
        code = run.wait(timeout=600)  # far below endpoint.timeout=3600: it returned because it noticed
        print(f"\nSIGTERM to the server: the run ended {time.monotonic() - terminated:.1f} s later")
    finally:
        run.kill()
    text = log.read_text()
    assert code == 1, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("evalkit: error:")]
    assert len(errors) == 1, text[-3000:]
    # noticed by the /health watcher, or first by the retries of a request sent after the server stopped listening
    failed = re.fullmatch(rf"evalkit: error: ServedError: (\d) of 5 requests failed: (the server at {root} is gone \(its "
                          r"/health did not answer 3 times in a row while requests were in flight: shut down or "
                          rf"restarted\)|the server at {root} refused connections \(ConnectError: All connection "
                          r"attempts failed after \d tries\))", errors[0])
    assert failed and "Traceback" not in text, text[-3000:]
    (store,) = (tmp_path / "result" / "smollm2-135m-instruct" / ".requests").glob("*.jsonl")
    assert len(store.read_text().splitlines()) == 5 - int(failed.group(1)) >= 1  # every finished answer kept


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

    from evalkit.engine.served import start

    log = tmp_path / "log"
    with open(log, "w") as out:
        run = subprocess.Popen([sys.executable, "-m", "evalkit", "engine=served", "endpoint.serve=true", "limit=40",
                                "gpu_memory_utilization=0.15", EAGER, f"output_dir={tmp_path / 'result'}"],
                               stdout=out, stderr=out)
    deadline = time.monotonic() + 600
    while not re.search(r"evalkit: engine=served: ", log.read_text()):
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    guards = [p for p in psutil.Process(run.pid).children(recursive=True)  # not the session's server's guard
              if "evalkit.engine.served.start" in " ".join(p.cmdline()) and "GUARD" in p.cmdline()]
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


@pytest.mark.engine
def test_close_stops_the_whole_server_group(served):
    """Every process of the server's group is gone when close() returns; a zombie (an orphan that init reaps late
    on this machine) holds no memory and counts as gone, as evalkit/engine/machine/process_group.py defines it."""
    from evalkit.engine.machine.process_group import live_members

    group = served.server.process.pid
    assert live_members(group)
    served.close()
    assert live_members(group) == []
