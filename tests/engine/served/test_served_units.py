"""engine=served (evalkit/engine/served/) without a vLLM server: the bodies, the reads, the retries, the config,
the store. Responses are built with vLLM's own protocol classes; retries run against a real HTTP server in a
thread. The real server: tests/engine/served/test_served.py.
Run: pytest tests/engine/served/test_served_units.py
"""

import json
import threading
import time

import pytest

from evalkit.config import ConfigError, compose_config, validate
from evalkit.contracts import GenRequest, PartialAnswers, ScoreRequest
from evalkit.engine.served import body
from evalkit.store.fingerprint import fingerprint
from evalkit.store.requests import RequestStore, ResumableEngine
from evalkit.engine.served.http import Client, Failure
from tests.engine.served.local_http import QuietHandler, answer_json, running, serve
from tests.fake_engine import FakeEngine


def test_sampling_defaults_are_vllms_and_a_server_default_cannot_leak_in():
    from vllm import SamplingParams
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    defaults = SamplingParams()
    assert {k: getattr(defaults, k) for k in body.SAMPLING_DEFAULTS} == body.SAMPLING_DEFAULTS
    request = GenRequest(prompt_ids=(1, 2, 3), max_tokens=7, stop=("\n",),
                         sampling=(("skip_special_tokens", False), ("temperature", 0.0)))
    sent = body.generate_body(request, "m")
    assert sent["prompt"] == [1, 2, 3] and sent["return_token_ids"] and set(body.SAMPLING_DEFAULTS) <= set(sent)
    server_defaults = {"temperature": 0.7, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.3,
                       "presence_penalty": 0.2, "frequency_penalty": 0.2}  # a generation_config's
    served = CompletionRequest(**sent).to_sampling_params(7, server_defaults)
    offline = SamplingParams(**dict(request.sampling), max_tokens=7, stop=["\n"])
    for name in [*server_defaults, "seed", "stop", "skip_special_tokens", "include_stop_str_in_output", "max_tokens"]:
        assert getattr(served, name) == getattr(offline, name), name
    with pytest.raises(body.ServedReadError, match="detokenize have no field"):
        body.generate_body(GenRequest(prompt_ids=(1,), max_tokens=1, sampling=(("detokenize", False),)), "m")


def usage_info():
    """vLLM's UsageInfo, where the installed vLLM keeps it: vllm/entrypoints/serve/engine/protocol.py in 0.32,
    vllm/entrypoints/openai/engine/protocol.py in 0.23."""
    try:
        from vllm.entrypoints.serve.engine.protocol import UsageInfo
    except ImportError:
        from vllm.entrypoints.openai.engine.protocol import UsageInfo
    return UsageInfo


def vllm_response(prompt, rows=None, token_ids=(5,), finish="length", top=None):
    """A /v1/completions response as vLLM's server writes it (0.32's classes, or 0.23's), through JSON."""
    from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs, CompletionResponse,
                                                             CompletionResponseChoice)
    from vllm.logprobs import Logprob

    UsageInfo = usage_info()  # noqa: N806 (vLLM's class)

    prompt_logprobs = None if rows is None else [None] + [
        {t: Logprob(logprob=v, rank=r, decoded_token="x") for t, (v, r) in row.items()} for row in rows]
    logprobs = None if top is None else CompletionLogProbs(top_logprobs=[top], token_logprobs=[0.0], tokens=["t"])
    choice = CompletionResponseChoice(index=0, text="hi", finish_reason=finish, token_ids=list(token_ids),
                                      prompt_token_ids=list(prompt), prompt_logprobs=prompt_logprobs,
                                      logprobs=logprobs)
    response = CompletionResponse(model="m", choices=[choice], usage=UsageInfo(prompt_tokens=len(prompt)))
    return json.loads(response.model_dump_json())


def test_reads_check_themselves_on_responses_shaped_as_vllms_server_writes_them():
    request = ScoreRequest(ids=(1, 7, 8), start=1)
    rows = [{7: (-0.5, 1)}, {8: (-2.0, 2), 9: (-2.0, 1)}]  # a tie with the best: greedy, as offline
    assert body.read_prompt_logprobs(request, vllm_response(request.ids, rows)).logprob == pytest.approx(-2.5)
    assert body.read_prompt_logprobs(request, vllm_response(request.ids, rows)).is_greedy
    lower = [{7: (-0.5, 1)}, {8: (-3.0, 4), 9: (-1.0, 1)}]
    assert not body.read_prompt_logprobs(request, vllm_response(request.ids, lower)).is_greedy
    for bad, message in (([{7: (-0.5, 1)}, {9: (-1.0, 1)}], "lacks the request's token 8"),
                         ([{7: (-0.5, 1)}, {8: (float("-inf"), 9)}], "not a finite value"),
                         ([{7: (-0.5, 1)}], "2 prompt rows for a 3-token prompt")):
        with pytest.raises(body.ServedReadError, match=message):
            body.read_prompt_logprobs(request, vllm_response(request.ids, bad))
    with pytest.raises(body.ServedReadError, match="saw a 2-token prompt"):
        body.read_prompt_logprobs(request, vllm_response((1, 7), rows[:1]))
    gen = GenRequest(prompt_ids=(1, 2), max_tokens=1)
    assert body.read_generation(gen, vllm_response((1, 2))).token_ids == (5,)
    with pytest.raises(body.ServedReadError, match="finish_reason 'abort'"):
        body.read_generation(gen, vllm_response((1, 2), finish="abort"))
    top = {"token_id:5": -0.1, "token_id:9": -4.0}
    assert body.read_next_token((1, 2), [9], vllm_response((1, 2), top=top)) == {5: -0.1, 9: -4.0}
    with pytest.raises(body.ServedReadError, match="ignored return_tokens_as_token_ids"):
        body.read_next_token((1, 2), [9], vllm_response((1, 2), top={" a": -0.1}))


class Flaky(QuietHandler):
    """/flaky: 503 on every first try of a body, then 200; /bad: 400; /hang: answers after 5 s; /slow: counts
    the requests in flight at once."""

    seen: dict = {}
    in_flight = [0, 0]  # now, most

    def do_POST(self):  # noqa: N802 (http.server's name)
        sent = self.rfile.read(int(self.headers["Content-Length"]))
        key = (self.path, sent)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.path == "/hang":
            time.sleep(5)
        if self.path == "/slow":
            self.in_flight[0] += 1
            self.in_flight[1] = max(self.in_flight)
            time.sleep(0.05)
            self.in_flight[0] -= 1
        status = {"/bad": 400, "/flaky": 503 if self.seen[key] == 1 else 200}.get(self.path, 200)
        answer_json(self, status, b'{"ok": true}' if status == 200 else b'{"error": "no"}')


def test_retries_only_what_is_transient_and_bounds_the_requests_in_flight():
    with running(Flaky) as url:
        client = Client(url, api_key=None, max_concurrency=3, timeout=0.5, retries=2, backoff=0.01)
        flaky, bad, hang = [client.post_many(p, [{"n": 1}])[0] for p in ("/flaky", "/bad", "/hang")]
        assert flaky == {"ok": True} and Flaky.seen[("/flaky", b'{"n":1}')] == 2
        assert bad == Failure('HTTP 400: {"error": "no"}') and Flaky.seen[("/bad", b'{"n":1}')] == 1
        assert hang == Failure("timed out after 3 tries")
        assert client.post_many("/slow", [{"n": i} for i in range(12)]) == [{"ok": True}] * 12
        assert Flaky.in_flight[1] == 3


def test_bad_endpoint_settings_fail_in_one_line():
    for overrides, message in ((["engine=served"], "needs endpoint.url"),
                               (["engine=served", "endpoint.url=localhost:8000"], "must start with http"),
                               (["engine=served", "endpoint.serve=true", "endpoint.url=http://h/v1"], "leave endpoint.url"),
                               (["engine=served", "endpoint.url=http://h/v1", "endpoint.api_key_env=EVALKIT_NO_SUCH_KEY"],
                                "is not set"),
                               (["engine=served", "endpoint.url=http://h/v1", "endpoint.max_concurrency=0"], "more than 0")):
        with pytest.raises(ConfigError, match=message) as error:
            validate(compose_config(overrides))
        assert "\n" not in str(error.value)


class HalfAnswered(FakeEngine):
    def score(self, requests, progress=None, *, fast=True, top_k=0):
        answers = super().score(requests, progress, fast=fast, top_k=top_k)
        raise PartialAnswers("1 of 2 requests failed", [answers[0], None])


def test_a_failed_batch_keeps_its_finished_answers(tmp_path):
    store = RequestStore(tmp_path / "store.jsonl")
    requests = [ScoreRequest(ids=(1, 97, 98), start=1), ScoreRequest(ids=(1, 97, 99), start=1)]
    with pytest.raises(PartialAnswers):
        ResumableEngine(HalfAnswered(), store, chunk_size=8).score(requests)
    store.close()
    again = ResumableEngine(FakeEngine(), RequestStore(tmp_path / "store.jsonl"), chunk_size=8)
    again.score(requests)
    assert (again.reused, again.computed) == (1, 1)


def test_a_served_store_is_keyed_on_the_deployment_and_the_tokenizer_not_the_url_or_weights(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"1")
    served = {"name": "served", "engine_args": {"url": "http://a/v1", "tokenizer": str(tmp_path)},
              "deployment": {"model": "m", "root": "/models/m", "max_model_len": 4096, "version": "0.32.0"}}
    first = fingerprint(str(tmp_path), served)
    (tmp_path / "model.safetensors").write_bytes(b"2")
    assert fingerprint(str(tmp_path), {**served, "engine_args": {**served["engine_args"], "url": "http://b/v1"}}) == first
    assert fingerprint(str(tmp_path), {**served, "deployment": {**served["deployment"], "version": "0.33"}}) != first
    # vLLM's system_fingerprint hashes the engine's configuration (dtype, attention backend, parallel layout)
    rebuilt = {**served["deployment"], "system_fingerprint": "vllm-0.32.0-e472885f"}
    assert fingerprint(str(tmp_path), {**served, "deployment": rebuilt}) != first
    (tmp_path / "tokenizer.json").write_text('{"a": 1}')
    assert fingerprint(str(tmp_path), served) != first


class Stalls(QuietHandler):
    """A POST whose body asks to stall is held open without an answer until the test lets it go, as vLLM's server
    leaves a request in flight on a keep-alive connection while it shuts down; others are answered at once."""

    release = threading.Event()

    def do_GET(self):  # noqa: N802 (http.server's name)
        self._answer(200 if self.path == "/health" else 404)

    def do_POST(self):  # noqa: N802
        if json.loads(self.rfile.read(int(self.headers["Content-Length"]))).get("stall"):
            self.release.wait(60)
        self._answer(200)

    def _answer(self, status):
        answer_json(self, status, b'{"ok": true}')


def shut_down_gracefully(server, after: float) -> None:
    """Like vLLM's server on SIGTERM: stop accepting connections (new ones are refused), keep the open ones."""
    time.sleep(after)
    server.shutdown()
    server.server_close()


def test_a_server_that_goes_away_with_requests_in_flight_is_noticed_long_before_the_timeout():
    """Two requests answered, two held open by a server that then stops listening: the watcher finds /health
    refused on new connections and the held ones fail naming the server, while the timeout is 600 s."""
    Stalls.release.clear()
    server = serve(Stalls)
    client = Client(f"http://127.0.0.1:{server.server_port}/v1", api_key=None, max_concurrency=4, timeout=600,
                    retries=3, backoff=0.01, health_poll=0.2)
    threading.Thread(target=shut_down_gracefully, args=(server, 1.0), daemon=True).start()
    started = time.monotonic()
    try:
        answers = client.post_many("/completions", [{}, {"stall": True}, {}, {"stall": True}])
    finally:
        Stalls.release.set()
    assert answers[0] == answers[2] == {"ok": True}  # finished answers are kept
    gone = f"the server at http://127.0.0.1:{server.server_port} is gone (its /health did not answer 3 times in a row"
    assert all(isinstance(a, Failure) and a.reason.startswith(gone) for a in (answers[1], answers[3])), answers
    assert time.monotonic() - started < 60  # far from the 600 s timeout: noticed, not waited for


def test_a_server_back_within_reconnect_wait_gets_the_unfinished_requests_again():
    Stalls.release.clear()
    server = serve(Stalls)
    port = server.server_port
    client = Client(f"http://127.0.0.1:{port}/v1", api_key=None, max_concurrency=4, timeout=600, retries=3,
                    backoff=0.01, health_poll=0.2, reconnect_wait=60)
    back = []

    def restart():
        shut_down_gracefully(server, 1.0)
        time.sleep(2.0)  # gone for a while: the watcher notices, then waits
        Stalls.release.set()  # the old server's held requests end with it
        back.append(serve(Stalls, port))

    threading.Thread(target=restart, daemon=True).start()
    answers = client.post_many("/completions", [{}, {"stall": True}])
    assert answers == [{"ok": True}, {"ok": True}]  # the held one sent again to the server that came back
    back[0].shutdown()


def test_a_refused_connection_names_the_server_without_its_credentials():
    """Nothing listens at the address (the server stopped, or never started): each request fails after its
    retries naming the server and that it refused connections, and the start's first request fails the run
    with that line alone."""
    import socket

    from evalkit.engine.served.probe import ServerRefused, deployment

    with socket.socket() as closed:  # a port that listened a moment ago
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    client = Client(f"http://user:secret@127.0.0.1:{port}/v1", api_key=None, max_concurrency=2, timeout=5,
                    retries=1, backoff=0.01)
    refused = (f"the server at http://127.0.0.1:{port} refused connections (ConnectError: All connection attempts "
               "failed after 2 tries)")
    assert client.post_many("/completions", [{}, {}]) == [Failure(refused, refused=True)] * 2
    with pytest.raises(ServerRefused) as error:
        deployment(client, None, 4096)
    assert str(error.value) == refused


def test_what_names_a_servers_weights(tmp_path):
    """The rule (docs/served.md, "Which answers are reused"): a server evalkit started is keyed on the content of
    the weights it started it from; a server it did not start only on the id the user gives, and without one its
    answers cannot be kept; each changes the store's name."""
    from evalkit.engine.served.probe import ServerRefused, weights_identity

    (tmp_path / "model.safetensors").write_bytes(b"Q4")
    (tmp_path / "tokenizer.json").write_text("{}")
    started = weights_identity(started_from=str(tmp_path), deployment_id=None, keeps_answers=True, url="")
    (tmp_path / "model.safetensors").write_bytes(b"Q8")  # other weights at the same path
    replaced = weights_identity(started_from=str(tmp_path), deployment_id=None, keeps_answers=True, url="")
    assert set(started) == {"weights"} and started != replaced
    given = weights_identity(started_from=None, deployment_id="q4-2026-11", keeps_answers=True, url="http://h/v1")
    assert given == {"id": "q4-2026-11"}
    with pytest.raises(ServerRefused, match=r"^the server at http://h/v1 cannot say which weights it serves .*"
                                            r"pass endpoint.deployment=ID.* or resume=false to keep none$"):
        weights_identity(started_from=None, deployment_id=None, keeps_answers=True, url="http://h/v1")
    assert weights_identity(started_from=None, deployment_id=None, keeps_answers=False, url="http://h/v1") == {}
    served = {"name": "served", "engine_args": {"tokenizer": str(tmp_path)},
              "deployment": {"model": "default", "root": None, "max_model_len": None, "version": None}}
    keys = {fingerprint(str(tmp_path), {**served, "deployment": {**served["deployment"], **identity}})
            for identity in (started, replaced, given, {"id": "q8-2026-12"})}
    assert len(keys) == 4  # llama.cpp serving Q4 then Q8 as "default": two stores, never one


def test_a_server_that_is_not_there_is_said_before_the_deployment_id_it_would_need(tmp_path):
    """Through the CLI, nothing listening at endpoint.url and no endpoint.deployment: the real problem first, one
    line, exit 2, nothing written (a server that is there and has no deployment id: tests/engine/served/
    test_served.py)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "evalkit", "engine=served", "endpoint.url=http://127.0.0.1:9/v1",
                           f"output_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and not (tmp_path / "out").exists(), done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "evalkit: error: the server at http://127.0.0.1:9 refused connections (ConnectError: All connection "
        "attempts failed)"]


def test_reconnect_wait_is_checked():
    with pytest.raises(ConfigError, match=r"^endpoint.reconnect_wait=-1.0 must be 0 or more \(seconds\)$"):
        validate(compose_config(["engine=served", "endpoint.url=http://h/v1", "endpoint.reconnect_wait=-1"]))


def test_more_than_128_next_token_ids_go_in_several_bodies_that_vllm_accepts(embedded_model_dir):
    """200 two-token choices behind one question (" is" and one of 200 tokens), chained as ServedEngine chains
    them: the 200 last tokens share one context, and vLLM 0.32 takes at most 128 logprob_token_ids a request.
    They go in two bodies, each turned into SamplingParams by vLLM's own CompletionRequest and passing vLLM's
    own validation (SamplingParams.verify against the model's ModelConfig); the one body asking all 200 fails
    there."""
    from vllm.config import ModelConfig
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    from evalkit.engine.logprob_reads import next_token_asks, token_steps
    from evalkit.engine.served.body import MAX_LOGPROB_TOKEN_IDS

    config = ModelConfig(model=embedded_model_dir, max_model_len=4096)

    def verified(sent):
        CompletionRequest(**sent).to_sampling_params(1).verify(config, None, None, None)

    question, is_ = (1, 510, 3437), 314
    requests = [ScoreRequest(ids=question + (is_, 1000 + w), start=3) for w in range(200)]
    _, steps = token_steps(requests)
    asks = next_token_asks(steps, MAX_LOGPROB_TOKEN_IDS)
    assert sorted(len(ids) for _, ids in asks) == [1, 72, 128]
    assert {t for c, ids in asks if c == question + (is_,) for t in ids} == set(range(1000, 1200))
    for context, ids in asks:
        verified(body.next_token_body(context, ids, "m", "salt"))
    with pytest.raises(VLLMValidationError, match="greater than max allowed: 128"):
        verified(body.next_token_body(question + (is_,), list(range(1000, 1200)), "m", "salt"))


def test_locate_restarts_a_served_run_recorded_without_a_deployment_id():
    """--locate keeps no answers, so a served run recorded before endpoint.deployment existed (or with
    resume=false) starts its engine again without one."""
    from dataclasses import asdict

    from evalkit.compare.locate.engines import config_from
    from evalkit.engine.served.probe import weights_identity

    recorded = asdict(compose_config(["engine=served", "endpoint.url=http://h/v1"]))
    cfg = config_from(recorded, [], "--cand-engine")
    assert not cfg.resume and cfg.endpoint.deployment is None
    assert weights_identity(started_from=None, deployment_id=None, keeps_answers=cfg.resume, url="http://h/v1") == {}


def test_a_sweeps_served_point_is_done_only_while_the_weights_evalkit_served_are_unchanged(tmp_path):
    """A completed endpoint.serve=true run is keyed on the weights it served; the sweep's check reads them again,
    so other weights at the same path run the point again."""
    from evalkit.engine.served.probe import weights_identity
    from evalkit.sweep.points import described_here

    (tmp_path / "model.safetensors").write_bytes(b"Q4")
    (tmp_path / "tokenizer.json").write_text("{}")
    identity = weights_identity(started_from=str(tmp_path), deployment_id=None, keeps_answers=True, url="")
    recorded = {"name": "served", "engine_args": {"tokenizer": str(tmp_path)}, "model_dir": str(tmp_path),
                "deployment": {"model": "m", "root": None, "max_model_len": None, "version": "0.32.0", **identity}}
    machine = {"versions": {}, "hardware": {}}
    assert fingerprint(str(tmp_path), described_here(recorded, machine)) == \
        fingerprint(str(tmp_path), {**recorded, **machine})
    (tmp_path / "model.safetensors").write_bytes(b"Q8")
    assert fingerprint(str(tmp_path), described_here(recorded, machine)) != \
        fingerprint(str(tmp_path), {**recorded, **machine})


def test_prompts_that_differ_only_in_their_prompt_are_sent_together_and_each_answer_is_read_alone():
    """batch.Sender's bundles: bodies equal but for prompt and cache_salt go in one request (at most the bundle's
    size, the first member's salt), and the response is split into one choice per prompt by its index; choices
    that do not answer the prompts one each fail every member's read."""
    from evalkit.engine.logprob_reads import BadRead
    from evalkit.engine.served.batch import bundles, joined, split
    from evalkit.engine.served.http import prompts_in

    bodies = [{"prompt": [i, i + 1], "max_tokens": 4 if i % 3 else 8, "cache_salt": f"s{i}"} for i in range(7)]
    groups = bundles(bodies, 2)
    assert groups == [[0, 3], [6], [1, 2], [4, 5]]
    together = joined(bodies, groups[0])
    assert together == {"prompt": [[0, 1], [3, 4]], "max_tokens": 8, "cache_salt": "s0"} and prompts_in(together) == 2
    assert joined(bodies, [6]) is bodies[6] and prompts_in(bodies[6]) == 1
    answer = {"system_fingerprint": "f", "choices": [{"index": 1, "text": "b"}, {"index": 0, "text": "a"}]}
    assert split(answer, [0, 3]) == [{"system_fingerprint": "f", "choices": [{"index": 0, "text": "a"}]},
                                     {"system_fingerprint": "f", "choices": [{"index": 1, "text": "b"}]}]
    for wrong in ({"choices": [{"index": 0}]}, {"choices": [{"index": 0}, {"index": 0}]}, {"choices": None}):
        spoiled = split(wrong, [0, 3])
        assert len(spoiled) == 2 and all(isinstance(s, BadRead) for s in spoiled), wrong
    assert split(Failure("x"), [0, 3]) == [Failure("x")] * 2


def test_a_request_weighs_its_prompts_in_the_window():
    """Gate.held(weight): a request enters while the prompts in flight stay within the window; one heavier than
    the window goes alone."""
    import asyncio

    from evalkit.engine.served.concurrency import Gate, Window

    async def run() -> list[int]:
        gate, seen = Gate(Window(cap=4)), []

        async def one(weight: int) -> None:
            async with gate.held(weight):
                seen.append(gate.in_flight)
                await asyncio.sleep(0.01)

        await asyncio.gather(one(3), one(3), one(9), one(1))
        return [*seen, gate.peak]

    assert asyncio.run(run()) == [3, 4, 3, 9, 9]
