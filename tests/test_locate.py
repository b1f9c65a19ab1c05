"""`python -m evalkit.compare REF CAND --locate`: every changed document explained at the token where it changed.

* pure: divergence, classification and the "Why" section on hand-made TokenTrace data; prompt ids rebuilt
  from run folders made through lm-eval with the fake engine (which records what it was sent);
* the one-line error when an engine cannot be set up (a run whose model folder is gone, a bad override);
* on the real engines: tests/test_locate_engine.py.
Run: pytest tests/test_locate.py
"""

import json
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from evalkit.compare import cli, locate
from evalkit.compare.pages import markdown, plots

from evalkit.compare.locate import why
from evalkit.compare.statistics import paired
from evalkit.compare import runs as on_disk
from evalkit.contracts import TokenTrace
from evalkit.harness.lm import EvalkitLM
from tests.fake_engine import FakeEngine
from tests.test_compare import fake_run

PROMPT = (10, 11, 12)
SEQ = why.Sequences(prompt=PROMPT, reference=(20, 21, 22), candidate=(20, 23))  # diverge at output token 1


def trace(logprobs, top=None) -> TokenTrace:
    return TokenTrace(logprobs=tuple(logprobs), top=tuple(top or [((0, lp),) for lp in logprobs]))


def engine_traces(shared, ref_token, cand_token, ref_tail=-0.3):
    """One engine's (reference, candidate) traces of SEQ: the reference sequence from position 1 (prompt 11,
    12; output 20, 21, 22), the candidate's from the prompt's end (20, 23)."""
    ref = trace([*shared, ref_token, ref_tail],
                top=[((0, s),) for s in shared] + [((21, ref_token), (23, cand_token)), ((22, ref_tail),)])
    return ref, trace([shared[-1], cand_token])


def test_divergence_is_the_first_differing_index_or_the_shorter_length():
    assert why.divergence([1, 2, 3], [1, 2, 3]) is None
    assert why.divergence([1, 2, 3], [1, 5, 3]) == 1
    assert why.divergence([1, 2], [1, 2, 3]) == 2 and why.divergence([], [4]) == 0


@pytest.mark.parametrize("ref_margin, cand_margin, drift, kind", [
    (0.05, -0.06, 1.0, "near-tie"),  # a tie on both engines, whatever else moved
    (0.05, -0.5, 1e-3, "logit drift"),  # the candidate leans clearly the other way, and drifted
    (0.5, -0.5, 1e-3, "logit drift"),
    (0.5, -0.5, 5e-5, "other"),  # no tie, no drift beyond the floor
    (None, None, None, "other"),
    (0.1, -0.1, 0.0, "near-tie"),  # the bound is inclusive
])
def test_classify(ref_margin, cand_margin, drift, kind):
    assert why.classify(ref_margin, cand_margin, drift, near_tie=0.1, floor=1e-4) == kind


def test_explain_reads_both_engines_at_the_divergence_and_the_drift_before_it():
    shared_ref, shared_cand = [-1.0, -2.0, -0.1], [-1.0, -2.02, -0.1]  # positions 1, 2 (prompt) and output token 0
    flip = why.explain("t", 7, SEQ, ref_engine=engine_traces(shared_ref, -0.2, -1.7),
                       cand_engine=engine_traces(shared_cand, -1.0, -0.4), near_tie=0.1, floor=1e-4,
                       prompt_tail="Q?")
    assert (flip.index, flip.ref_token, flip.cand_token) == (1, 21, 23)
    assert flip.ref_side.margin == pytest.approx(1.5) and flip.cand_side.margin == pytest.approx(-0.6)
    assert flip.ref_side.top == ((21, -0.2), (23, -1.7))
    assert flip.drift == pytest.approx(0.02) and flip.kind == "logit drift"
    # positions 1..divergence on the reference's tokens; the last is the divergent token itself
    assert flip.deltas == pytest.approx((0.0, -0.02, 0.0, -0.8))
    same = why.explain("t", 7, SEQ, ref_engine=engine_traces(shared_ref, -0.2, -1.7),
                       cand_engine=engine_traces(shared_ref, -1.0, -0.4), near_tie=0.1, floor=1e-4)
    assert same.drift == 0.0 and same.kind == "other"
    tie = why.explain("t", 7, SEQ, ref_engine=engine_traces(shared_ref, -0.50, -0.55),
                      cand_engine=engine_traces(shared_cand, -0.52, -0.50), near_tie=0.1, floor=1e-4)
    assert tie.kind == "near-tie"
    assert why.explain("t", 7, why.Sequences(PROMPT, (1, 2), (1, 2)), ref_engine=engine_traces(shared_ref, 0, 0),
                       cand_engine=engine_traces(shared_ref, 0, 0), near_tie=0.1, floor=1e-4) is None


def test_an_output_that_ends_where_the_other_goes_on_has_no_margin():
    seq = why.Sequences(prompt=PROMPT, reference=(20,), candidate=(20, 23))
    ref = (trace([-1.0, -2.0, -0.1]), trace([-0.1, -3.0]))
    cand = (trace([-1.0, -2.5, -0.1]), trace([-0.1, -0.2]))
    flip = why.explain("t", 1, seq, ref_engine=ref, cand_engine=cand, near_tie=0.1, floor=1e-4)
    assert (flip.index, flip.ref_token, flip.cand_token, flip.ref_side.margin) == (1, None, 23, None)
    assert flip.cand_side.cand_logprob == -0.2 and flip.drift == pytest.approx(0.5) and flip.kind == "logit drift"


def test_differing_generations_once_per_document_and_those_without_output_ids():
    def sample(doc, text, ids):
        return {"doc_id": doc, "raw_output": text, "requests": [{"kind": "generate_until", "output_ids": ids}]}

    ref = {"t": {(0, "a"): sample(0, " 1", [5]), (0, "b"): sample(0, " 1", [5]), (1, "a"): sample(1, " 2", [6]),
                 (2, "a"): {"doc_id": 2, "raw_output": " 3"}}}
    cand = {"t": {(0, "a"): sample(0, " 4", [7]), (0, "b"): sample(0, " 4", [7]), (1, "a"): sample(1, " 2", [6]),
                  (2, "a"): {"doc_id": 2, "raw_output": " 9"}}}
    found, skipped = why.differing(ref, cand)
    assert [(d.task, d.doc_id) for d in found] == [("t", 0)] and found[0].sequences((1,)).candidate == (7,)
    assert skipped == ["t doc 2: no output_ids recorded (a run made before evalkit kept them)"]


def choice_sample(doc_id, lls):
    return {"doc_id": doc_id, "raw_output": None, "resps": [[[ll, False]] for ll in lls]}


def test_changed_choices_from_the_recorded_log_likelihoods():
    ref = {"mc": {(0, "none"): choice_sample(0, [-1.0, -1.05, -3.0]), (1, "none"): choice_sample(1, [-1.0, -4.0]),
                  (2, "none"): choice_sample(2, [-1.0, -2.0])}}
    cand = {"mc": {(0, "none"): choice_sample(0, [-1.02, -1.0, -3.0]), (1, "none"): choice_sample(1, [-3.0, -2.0]),
                   (2, "none"): choice_sample(2, [-1.1, -2.0])}}
    tie, drift = why.choice_changes(ref, cand, near_tie=0.1, floor=1e-4)
    assert (tie.doc_id, tie.ref_choice, tie.cand_choice, tie.kind) == (0, 0, 1, "near-tie")
    assert tie.ref_margin == pytest.approx(0.05) and tie.cand_margin == pytest.approx(-0.02)
    assert (drift.doc_id, drift.kind, drift.ref_margin, drift.cand_margin) == (1, "logit drift", 3.0, -1.0)
    assert drift.drift == 2.0
    assert why.noise_floor(ref, cand) == pytest.approx(2.0)
    assert why.noise_floor(ref, {"other": cand["mc"]}) is None


def localisation(kinds):
    flips = [why.Flip(task="evalkit_arith", doc_id=d, index=1, ref_token=21, cand_token=23,
                      ref_side=why.Side(-0.2, -0.25 if k == "near-tie" else -1.7, ((21, -0.2), (23, -1.7))),
                      cand_side=why.Side(-0.5, -0.45, ((23, -0.45), (21, -0.5))), drift=0.3, deltas=(0.0, 0.3, -0.1),
                      prompt_tokens=3, kind=k, prompt_tail="What is 2 + 2?\nAnswer:", shared_output=" ",
                      text={21: "4", 23: "5"}) for d, k in enumerate(kinds)]
    return why.Localisation(reference="m/ref", candidate="m/cand", flips=flips, choices=[], near_tie=0.1,
                            floor=1e-4, floor_source="default", engines={"reference": "vllm, float32"},
                            seconds={"reference engine start": 20.0, "total": 31.5})


def compared(lost):
    table = pd.DataFrame([{"task": "evalkit_arith", "filter": "first-integer", "metric": "exact_match",
                           "verdict": "worse"}], columns=paired.ROW_COLUMNS)
    detail = paired.TaskDetail(task="evalkit_arith", filter="first-integer",
                               flips={"exact_match": {"right_to_wrong": lost, "wrong_to_right": []}})
    return table, [detail]


def test_why_section_counts_classes_names_tokens_and_says_when_worse_rests_on_near_ties():
    table, details = compared([0, 1])
    text = "\n".join(markdown.why_markdown(localisation(["near-tie", "near-tie", "logit drift"]), table, details))
    assert "3 located: near-tie 2, logit drift 1, other 0" in text and "localisation took" in text and "31.5 s" in text
    assert "evalkit_arith / exact_match is `worse` on near-ties only" in text
    assert "'What is 2 + 2?\\nAnswer:'" in text and "reference '4', candidate '5'" in text
    row = "| evalkit_arith | 0 | 1 | '4' | '5' | +0.050 | -0.050 | 0.3 | near-tie | exact_match: right -> wrong |"
    assert row in text
    mixed = "\n".join(markdown.why_markdown(localisation(["near-tie", "logit drift"]), table, details))
    assert "near-ties only" not in mixed


def test_why_plot_and_the_full_report():
    table, details = compared([0])
    images = plots.why_plots(localisation(["near-tie", "logit drift"]))
    plot = images["Why: drift up to the divergence"]
    assert plot.png[:8] == b"\x89PNG\r\n\x1a\n" and "noise floor" in plot.caption
    assert plots.why_plots(None) == {}
    text = markdown.markdown("a", "b", table.assign(n=1, reference=1.0, candidate=0.0, diff=-1.0, note=""), details,
                             tolerance=0.02, confidence=0.95, why=localisation(["logit drift"]))
    assert "## Why (--locate)" in text


def fake_pair(tmp):
    """Two runs through lm-eval with the fake engine (a tokenizer that adds BOS), the candidate replying
    ' 13' to everything: its generations differ from the reference's. Also the reference's engine."""
    ref_engine = FakeEngine(adds_bos=True)
    ref = fake_run(tmp, "a", ref_engine, tasks=["evalkit_arith"])
    cand = fake_run(tmp, "b", FakeEngine(adds_bos=True, reply=" 13"), tasks=["evalkit_arith"])
    return ref, cand, ref_engine


@pytest.fixture(scope="module")
def fake_runs(tmp_path_factory):
    return fake_pair(tmp_path_factory.mktemp("locate"))


def test_prompt_ids_rebuilt_from_the_samples_are_the_ids_the_harness_sent(fake_runs):
    ref, cand, engine = fake_runs
    jobs, skipped = why.differing(on_disk.load_run(ref).samples, on_disk.load_run(cand).samples)
    assert len(jobs) == 11 and not skipped  # doc 0's answer is 13 in both
    lm = EvalkitLM(FakeEngine(adds_bos=True), model_name="fake", max_tokens=64)
    sent = {r.prompt_ids for r in engine.generated}
    assert all(locate.prompt_ids(lm, job.ref) in sent for job in jobs)
    assert locate.prompt_ids(lm, jobs[0].ref)[0] == 1  # BOS, as the harness added it
    wrong = {**jobs[0].ref, "prompt": jobs[0].ref["prompt"] + " extra"}
    with pytest.raises(ValueError, match="rebuilt from its text has"):
        locate.prompt_ids(lm, wrong)


def test_a_run_whose_model_folder_is_gone_fails_in_one_line(tmp_path):
    ref, cand, _ = fake_pair(tmp_path)
    recorded = json.loads((ref / "results.json").read_text())["evalkit"]["engine"]["model_dir"]
    shutil.rmtree(recorded)  # both fake runs recorded this folder
    done = subprocess.run([sys.executable, "-m", "evalkit.compare", str(ref), str(cand), "--locate"],
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    # the exit code needs evalkit/compare/__main__.py to pass main()'s on: `raise SystemExit(main())`
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("evalkit.compare: error: reference run") and "does not exist" in lines[0]
    assert "pass --ref-engine vllm_path=/path/to/model" in lines[0]


@pytest.mark.parametrize("flags, message", [
    (["--ref-engine", "vllm_path=/nonexistent/model"], "reference engine: vllm_path=/nonexistent/model does not exist"),
    (["--cand-engine", "dtipe=float32"], "--cand-engine: unknown config key 'dtipe' (did you mean dtype?)"),
    (["--ref-engine", "dtype=float8"], "--ref-engine: dtype='float8' is not one of"),
])
def test_bad_engine_settings_fail_in_one_line_before_any_engine_starts(fake_runs, flags, message, capsys):
    ref, cand, _ = fake_runs
    assert cli.main([str(ref), str(cand), "--locate", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evalkit.compare: error: ") and message in err[0], err


def test_identical_runs_need_no_engine_and_take_the_floor_from_the_noise_runs(tmp_path, capsys):
    ref, same = fake_run(tmp_path, "a", FakeEngine()), fake_run(tmp_path, "b", FakeEngine())
    shutil.rmtree(tmp_path / "model")  # no engine is started, so none is looked for
    assert cli.main([str(ref), str(same), "--locate", "--noise", str(ref), str(same)]) == 0
    out = capsys.readouterr().out
    assert "generations that differ: 0 located" in out and "no engine started: no generation differs" in out
    assert "noise floor 0 nats (--noise: max per-choice log-likelihood difference" in out


def test_a_bfloat16_candidate_with_nothing_to_classify_needs_no_floor(tmp_path, capsys):
    """The default floor does not fit bfloat16; where no generation differs nothing needs one, and the report
    says so instead of failing."""
    ref, cand = (fake_run(tmp_path, name, FakeEngine(), tasks=["evalkit_arith"]) for name in ("a", "b"))
    data = json.loads((cand / "results.json").read_text())
    data["evalkit"]["engine"].setdefault("engine_args", {})["dtype"] = "bfloat16"
    (cand / "results.json").write_text(json.dumps(data))
    assert cli.main([str(ref), str(cand), "--locate"]) == 0
    text = (cand / f"compare-vs-{ref.parent.name}-{ref.name}.md").read_text()
    assert "- generations that differ: 0 located" in text and "noise floor (none known, none needed" in text


class Listener:
    """A loopback HTTP server standing in for a remote host named by a run folder: it records every request
    (path and Authorization header) and answers 500."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append((self.path, self.headers.get("Authorization")))
                self.send_error(500)

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener():
    found = Listener()
    yield found
    found.close()


def received(run, *, url, model_dir):
    """run's results.json as a sender could craft it: a served engine at url whose key is the user's HF_TOKEN, the
    sender's remote code, server flags, tokenizer and executor, and a model named by hub id or folder."""
    data = json.loads((run / "results.json").read_text())
    data["evalkit"]["config"].update(
        engine="served", endpoint={"url": url, "api_key_env": "HF_TOKEN", "serve": False},
        trust_remote_code=True, tokenizer="sender/tokenizer", distributed_executor_backend="ray",
        engine_kwargs={"host": "0.0.0.0", "worker_cls": "sender.Worker"}, dtype="float32")
    data["evalkit"]["engine"]["model_dir"] = model_dir
    (run / "results.json").write_text(json.dumps(data))


def test_a_received_run_sends_no_request_and_no_secret_and_fetches_no_hub_id(tmp_path, listener, monkeypatch, capsys):
    """A run folder naming a served engine at a host with the user's HF_TOKEN as its key, and a hub id as its
    model: --locate contacts neither; it stops before any engine starts, saying what to pass."""
    ref, cand, _ = fake_pair(tmp_path)
    for run in (ref, cand):
        received(run, url=listener.url, model_dir="sender/model")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_of_the_user")
    capsys.readouterr()  # what making the runs printed
    assert cli.main([str(ref), str(cand), "--locate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert listener.requests == []
    assert len(err) == 1 and "which --locate does not fetch on a run folder's word" in err[0], err
    assert "pass --ref-engine vllm_path=sender/model to fetch it" in err[0]


def test_a_received_config_decides_the_numbers_and_only_suggests_what_runs(tmp_path, listener):
    """What the engine computes with (dtype here) comes from the run; its engine kind, endpoint, secret name,
    remote code, tokenizer, executor and extra arguments do not: they are named as the flag that passes them."""
    from evalkit.compare.locate.engines import advice, engine_choice

    ref, _, _ = fake_pair(tmp_path)
    received(ref, url=listener.url, model_dir=str(tmp_path / "model"))
    choice = engine_choice(on_disk.load_run(ref), [], side="reference")
    cfg = choice.cfg
    assert (cfg.engine, cfg.endpoint.url, cfg.endpoint.api_key_env, cfg.trust_remote_code, cfg.tokenizer,
            cfg.engine_kwargs, cfg.distributed_executor_backend) == ("vllm", None, None, False, None, {}, None)
    assert cfg.dtype == "float32" and choice.model_dir == str(tmp_path / "model")
    line = advice(choice)
    for setting in ("engine=served", f"endpoint.url={listener.url}", "endpoint.api_key_env=HF_TOKEN",
                    "trust_remote_code=true", "tokenizer=sender/tokenizer", "+engine_kwargs.host=0.0.0.0",
                    "distributed_executor_backend=ray"):
        assert f" {setting}" in line, line
    passed = engine_choice(on_disk.load_run(ref), ["trust_remote_code=true"], side="reference")
    assert passed.cfg.trust_remote_code and "trust_remote_code=true" not in advice(passed)
    assert listener.requests == []


def test_an_interpolation_a_run_records_is_not_resolved(tmp_path, monkeypatch, capsys):
    """A received run records dtype as ${oc.env:HF_TOKEN}: --locate stops in one line naming the interpolation as
    written, never its value (OmegaConf would resolve it into the config, and the check's error would print the
    token); passing the setting itself gets past it."""
    from evalkit.compare.locate.engines import LocateError, engine_choice

    ref, cand, _ = fake_pair(tmp_path)
    for run in (ref, cand):
        data = json.loads((run / "results.json").read_text())
        data["evalkit"]["config"]["dtype"] = "${oc.env:HF_TOKEN}"
        (run / "results.json").write_text(json.dumps(data))
    monkeypatch.setenv("HF_TOKEN", "hf_secret_of_the_user")
    capsys.readouterr()
    assert cli.main([str(ref), str(cand), "--locate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hf_secret_of_the_user" not in err[0], err
    assert "--ref-engine: the run records dtype=${oc.env:HF_TOKEN}, an interpolation; --locate resolves nothing a " \
           "run folder records: pass the value itself, --ref-engine dtype=VALUE" in err[0], err
    with pytest.raises(LocateError, match="records model_name="):  # dtype given: the next one is refused
        data = json.loads((ref / "results.json").read_text())
        data["evalkit"]["config"]["model_name"] = "${oc.env:HF_TOKEN}"
        (ref / "results.json").write_text(json.dumps(data))
        engine_choice(on_disk.load_run(ref), ["dtype=float32"], side="reference")
    data["evalkit"]["config"]["model_name"] = "m"
    (ref / "results.json").write_text(json.dumps(data))
    assert engine_choice(on_disk.load_run(ref), ["dtype=float32"], side="reference").cfg.dtype == "float32"


def test_the_advice_to_pass_recorded_settings_is_quoted_for_the_shell(tmp_path, listener):
    """A received run records a tokenizer and an engine argument holding $(...) and a quote: the advice's flags,
    pasted into a shell, run nothing and give evalkit each setting as recorded."""
    from evalkit.compare.locate.engines import advice, engine_choice

    ref, _, _ = fake_pair(tmp_path)
    received(ref, url=listener.url, model_dir=str(tmp_path / "model"))
    data = json.loads((ref / "results.json").read_text())
    planted = tmp_path / "ran"
    data["evalkit"]["config"].update(tokenizer=f"$(touch {planted})", engine_kwargs={"x": "a'b `touch c` ; d"})
    (ref / "results.json").write_text(json.dumps(data))
    choice = engine_choice(on_disk.load_run(ref), [], side="reference")
    pasted = advice(choice).split(" pass --ref-engine ", 1)[1]
    shown = subprocess.run(["bash", "-c", f"printf '%s\\n' {pasted}"], capture_output=True, text=True, cwd=tmp_path,
                           check=True).stdout.splitlines()
    assert shown == list(choice.not_adopted) and f"tokenizer=$(touch {planted})" in shown
    assert "+engine_kwargs.x=a'b `touch c` ; d" in shown and not planted.exists()
    assert not (tmp_path / "c").exists()
