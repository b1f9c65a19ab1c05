"""The HF transformers reference engine (evalkit/engine/hf/, ``engine=hf``).

Engine-marked, on the embedded model in float32: against lm-eval's own ``hf`` backend on the same documents
(the same token ids scored and prompted, log-likelihoods within HF_LOGPROB_TOL, identical greedy
generations, the same forward-pass shapes at one batch size: one library on both sides, so any difference is
ours); ``trace`` against ``score``; against
the vLLM engine (both float32) on score requests and greedy generations; a rerun that reuses the request
store. The pure parts (sampling settings, refusals, stop strings, batching): tests/engine/hf/test_hf_settings.py.

Run: pytest -m engine -s tests/engine/hf/test_hf_engine.py
"""

import json
import subprocess
import sys

import pytest

from evalkit.config import TASKS_DIR, compose_config
from evalkit.contracts import GenRequest, ScoreRequest
from evalkit.engine.factory import start_engines
from evalkit.engine.wrapper import Wrapped
from evalkit.run.evaluate import evaluate, seed_as_lm_eval
from evalkit.run.results import read_samples
from tests.conftest import under_other_kernels

TASKS = ["evalkit_arith", "evalkit_facts"]
LIMIT = 20  # documents per task, batched as evalkit's default; one at a time (lm-eval's default), BY_ONE
BY_ONE = 8  # one sequence per forward pass is slow on a shared CPU
MAX_TOKENS = 256  # lm-eval's max_gen_toks default, as tests/test_parity.py
HF_LOGPROB_TOL = 1e-5  # nats per choice, evalkit's hf engine vs lm-eval's hf backend: one library
VLLM_LOGPROB_TOL = 1e-3  # nats per request, two implementations in float32
OUTPUT = (("skip_special_tokens", False), ("spaces_between_special_tokens", False))  # as evalkit's harness sends
GREEDY = (*OUTPUT, ("temperature", 0.0))


# --- the real engine ---
@pytest.fixture(scope="module")
def hf(embedded_model_dir):
    from evalkit.engine.hf.engine import HFEngine

    engine = HFEngine(model=embedded_model_dir, tokenizer=None, dtype="auto", max_model_len=4096, batch_size=None,
                      seed=1234, trust_remote_code=False, add_bos_token=None, engine_kwargs={})
    yield engine
    engine.close()


class Recording(Wrapped):
    """An engine whose score and generate requests are written down; everything else passes through
    (Wrapped), and closing it closes the engine."""

    def __init__(self, engine):
        super().__init__(engine)
        self.scored, self.generated = [], []
        self.answering = False  # within a score or generate call

    def score(self, requests, progress=None, *, fast=True, top_k=0):
        self.scored += requests
        return self.answer(self.engine.score, requests, progress, fast=fast, top_k=top_k)

    def generate(self, requests, progress=None, *, top_k=0):
        self.generated += requests
        return self.answer(self.engine.generate, requests, progress, top_k=top_k)

    def answer(self, call, *args, **kwargs):
        self.answering = True
        try:
            return call(*args, **kwargs)
        finally:
            self.answering = False


def lm_eval_hf(model_dir, batch_size):
    """lm-eval's own HFLM (float32, CPU), with the token ids it scores and prompts written down as it sends them
    to the model."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model_dir, dtype="float32", device="cpu", batch_size=batch_size)  # max_gen_toks: 256
    lm.scored, lm.generated = [], []
    score, generate = lm._loglikelihood_tokens, lm._model_generate

    def scored(requests, **kwargs):
        lm.scored += [(tuple(context), tuple(continuation)) for _, context, continuation in requests]
        return score(requests, **kwargs)

    def generated(context, max_length, stop, **kwargs):
        for row, mask in zip(context.tolist(), kwargs["attention_mask"].tolist()):
            ids = tuple(t for t, m in zip(row, mask) if m)
            lm.generated.append((ids, tuple(stop), max_length - len(row)))
        return generate(context, max_length, stop, **kwargs)

    lm._loglikelihood_tokens, lm._model_generate = scored, generated
    return lm


@pytest.fixture(scope="module", params=[1, 16], ids=["one-at-a-time", "batched"])
def against_lm_eval(request, embedded_model_dir, tmp_path_factory):
    """(evalkit's samples, lm-eval's samples, evalkit's requests, lm-eval's requests, run folder, documents per
    task), HF transformers on both sides with one batch size: one sequence per forward pass, or 16 (evalkit's
    default), padded."""
    from lm_eval import simple_evaluate

    from evalkit.harness.tasks import load_tasks

    batch = request.param
    limit = BY_ONE if batch == 1 else LIMIT
    cfg = compose_config([f"vllm_path={embedded_model_dir}", "engine=hf", "resume=false", f"limit={limit}",
                          f"max_tokens={MAX_TOKENS}", f"output_dir={tmp_path_factory.mktemp('hf')}",
                          f"tasks=[{','.join(TASKS)}]", *(["batch_size=1"] if batch == 1 else [])])
    ours, shapes = {}, {"ours": [], "theirs": []}

    def started(c, d):
        recording = ours.setdefault("engine", Recording(start_engines(c, d)))
        # the passes of lm-eval's requests; not those of the divergence record's traces, which lm-eval has not
        passes(recording.engine.loaded.model, shapes["ours"], when=lambda: recording.answering)
        return recording

    run_dir = evaluate(cfg, engine_factory=started)
    mine = {task: {(s["doc_id"], s["filter"]): s for s in read_samples(run_dir, task)} for task in TASKS}
    lm = lm_eval_hf(embedded_model_dir, batch)
    passes(lm.model, shapes["theirs"])
    seed_as_lm_eval(cfg.task_seeds)
    manager, tasks = load_tasks(TASKS, task_data={}, extra_dirs=[])
    outcome = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=True)
    theirs = {t: {(s["doc_id"], s["filter"]): s for s in samples} for t, samples in outcome["samples"].items()}
    recorded = ours["engine"]
    sent = (sorted((r.ids[:r.start], r.ids[r.start:]) for r in recorded.scored),
            sorted((r.prompt_ids, r.stop, r.max_tokens) for r in recorded.generated))
    return mine, theirs, sent, (sorted(lm.scored), sorted(lm.generated)), run_dir, limit, shapes


def passes(model, shapes, when=lambda: True):
    """Write down the shape of the input of each forward pass of model, (sequences, positions), while when()."""
    def pre_hook(module, args, kwargs):
        if when():
            shapes.append(tuple((args[0] if args else kwargs["input_ids"]).shape))

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


@pytest.mark.engine
def test_the_same_token_ids_are_scored_and_prompted_as_lm_evals_hf_backend(against_lm_eval):
    _, _, (ours_scored, ours_generated), (theirs_scored, theirs_generated), _, limit, _ = against_lm_eval
    assert len(ours_scored) == len(theirs_scored) > limit and ours_scored == theirs_scored
    assert len(ours_generated) == len(theirs_generated) == limit and ours_generated == theirs_generated


@pytest.mark.engine
def test_the_same_loglikelihoods_and_greedy_generations_as_lm_evals_hf_backend(against_lm_eval):
    ours, theirs, _, _, run_dir, limit, _ = against_lm_eval
    diffs, differ = [], {}
    for task in TASKS:
        assert set(ours[task]) == set(theirs[task]) and len(ours[task]) == limit
        for key, mine in ours[task].items():
            ref = theirs[task][key]
            assert mine["prompt_hash"] == ref["prompt_hash"]
            if mine["raw_output"] is None:  # log-likelihoods: [["logprob", "is_greedy"]] per choice
                diffs += [abs(float(a[0][0]) - b[0][0]) for a, b in zip(mine["resps"], ref["resps"])]
                assert [a[0][1] for a in mine["resps"]] == [str(b[0][1]) for b in ref["resps"]], (task, key)
            elif mine["resps"] != [[str(r) for r in rs] for rs in ref["resps"]]:
                differ[key[0]] = (mine["resps"], ref["resps"])
            for metric in ("acc", "acc_norm", "exact_match"):
                assert mine.get(metric) == ref.get(metric), (task, key, metric)
    batch = json.loads((run_dir / "results.json").read_text())["evalkit"]["engine"]["engine_args"]["max_num_seqs"]
    print(f"\nhf engine vs lm-eval hf, batch size {batch}: log-likelihood max |diff| {max(diffs):.1e} over "
          f"{len(diffs)} choices; generations identical {limit - len(differ)}/{limit}")
    assert max(diffs) <= HF_LOGPROB_TOL and not differ, differ


@pytest.mark.engine
def test_the_same_forward_passes_as_lm_evals_hf_backend_at_the_same_batch_size(against_lm_eval):
    """In bfloat16 (and on GPUs in any dtype) a sequence's last bits depend on the shape of the matrix products it
    goes through: the same batches, padded to the same length, in the same order, give lm-eval's numbers
    wherever both run; at one sequence a pass, lm-eval's default, and at 16, evalkit's."""
    shapes = against_lm_eval[6]
    assert shapes["ours"] and shapes["ours"] == shapes["theirs"], shapes


@pytest.mark.engine
def test_the_run_records_the_hf_engine(against_lm_eval):
    data = json.loads((against_lm_eval[4] / "results.json").read_text())
    engine = data["evalkit"]["engine"]
    assert engine["name"] == "hf" and engine["engine_args"]["dtype"] == "float32"
    assert engine["engine_args"]["device_map"] == "cpu" and engine["versions"]["transformers"]


def facts_requests(engine, documents=10):
    """The choices of evalkit_facts' first documents as score requests, built as lm-eval builds them."""
    requests = []
    for line in (TASKS_DIR / "evalkit_facts" / "test.jsonl").read_text().splitlines()[:documents]:
        doc = json.loads(line)
        context = f"Question: {doc['question']}\nAnswer:"
        for choice in doc["choices"]:
            ids = engine.encode(f"{context} {choice}", False)
            requests.append(ScoreRequest(ids=tuple(ids), start=len(engine.encode(context, False))))
    return requests


def prompts(engine):
    """Greedy requests meant to end every way: a stop string, the end-of-sequence token, max_tokens."""
    chat = engine.chat_prompt([{"role": "user", "content": "Say hello."}], True)
    arith = "Question: What is 2 + 3?\nAnswer: 5\n\nQuestion: What is 7 + 6?\nAnswer:"
    return [GenRequest(prompt_ids=tuple(engine.encode(arith, False)), max_tokens=16, stop=("\n", "Question:"),
                       sampling=GREEDY),
            GenRequest(prompt_ids=tuple(engine.encode(chat, False)), max_tokens=64, sampling=GREEDY),
            GenRequest(prompt_ids=tuple(engine.encode("Once upon a time", False)), max_tokens=12, sampling=GREEDY),
            GenRequest(prompt_ids=tuple(engine.encode("The capital of France is", False)), max_tokens=24,
                       stop=(" is", "."), sampling=GREEDY)]


@pytest.mark.engine
def test_trace_agrees_with_score_and_greedy_generations_score_as_greedy(hf):
    generations = hf.generate(prompts(hf))
    greedy = [ScoreRequest(ids=r.prompt_ids + g.token_ids, start=len(r.prompt_ids))
              for r, g in zip(prompts(hf), generations) if g.finish_reason == "length"]
    requests = [*facts_requests(hf), *greedy, ScoreRequest(ids=greedy[0].ids, start=0)]  # the last: from token 1
    scored, traces = hf.score(requests), hf.trace(requests, top_k=3)
    for r, s, t in zip(requests, scored, traces):
        assert len(t.logprobs) == len(t.top) == len(r.ids) - max(r.start, 1)
        assert abs(sum(t.logprobs) - s.logprob) <= 1e-5
        assert s.is_greedy == all(top[0][0] == token for top, token in zip(t.top, r.ids[max(r.start, 1):]))
        assert all(len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] for top in t.top)
    assert greedy and all(s.is_greedy for s in scored[-len(greedy) - 1:-1])
    assert not all(s.is_greedy for s in scored)
    # with top_k, the same forward pass answers each score's trace: the numbers trace reads
    one_pass = hf.score([*requests, ScoreRequest(ids=greedy[0].ids, start=len(greedy[0].ids))], top_k=3)
    assert [(s.logprob, s.is_greedy) for s in one_pass[:-1]] == [(s.logprob, s.is_greedy) for s in scored]
    assert [s.trace for s in one_pass] == [*traces, None] and all(s.trace is None for s in scored)
    assert all(g.trace is None for g in hf.generate(prompts(hf)[:1], top_k=3))  # traced by the harness apart


@pytest.mark.engine
def test_read_ids_gives_the_traces_values_in_the_order_asked(hf):
    """read_ids of a trace's top-20 ids in another order give its values in that order; ids outside it read below
    its 20th entry; 300 ids in one read; none asked: (); an empty context or an id outside the logits refused."""
    import random

    from evalkit.contracts import IdsRead

    rng = random.Random(0)
    requests = [ScoreRequest(ids=tuple(hf.encode(text, True)), start=1) for text in
                ("The capital of France is Paris.", "Question: What is 3 + 4?\nAnswer: 7")]
    reads, expected, tops = [], [], []
    for r, trace in zip(requests, hf.trace(requests, top_k=20)):
        for p, top in zip(range(1, len(r.ids)), trace.top):
            chosen = rng.sample(top, 8)
            others = rng.sample([t for t in range(len(hf.tokenizer)) if t not in dict(top)], 292)
            reads.append(IdsRead(context=r.ids[:p], ids=(*(t for t, _ in chosen), *others)))
            expected.append([v for _, v in chosen])
            tops.append(top)
    values = hf.read_ids([*reads, IdsRead(context=(1,), ids=())])
    assert values[-1] == () and len(values) == len(reads) + 1
    for got, want, top in zip(values, expected, tops):
        assert len(got) == 300 and list(got[:8]) == pytest.approx(want, abs=1e-5)
        assert max(got[8:]) <= top[-1][1] + 1e-5
    with pytest.raises(ValueError, match="after an empty context"):
        hf.read_ids([IdsRead(context=(), ids=(5,))])
    with pytest.raises(ValueError, match=r"ids \[-1\] are outside the model's"):  # not the last logit
        hf.read_ids([IdsRead(context=(1,), ids=(5, -1))])


@pytest.mark.engine
def test_sampled_draws_differ_and_a_request_with_its_own_seed_repeats_its_draw(hf):
    prompt = tuple(hf.encode("Once upon a time", False))
    sampled = GenRequest(prompt_ids=prompt, max_tokens=8, sampling=(*OUTPUT, ("temperature", 1.0)))
    seeded = GenRequest(prompt_ids=prompt, max_tokens=8, sampling=(*OUTPUT, ("seed", 11), ("temperature", 1.0)))
    draws = hf.generate([sampled] * 4 + [seeded] * 2)
    assert len({g.token_ids for g in draws[:4]}) == 4
    assert draws[4] == draws[5] == hf.generate([seeded])[0] and draws[4] not in draws[:4]


@pytest.mark.engine
def test_hf_and_vllm_agree_in_float32(hf, engine):
    assert str(engine.llm.llm_engine.model_config.dtype) == "torch.float32" and hf.args["dtype"] == "float32"
    requests = facts_requests(hf, documents=4)
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(hf.score(requests), engine.score(requests))]
    ours, theirs = hf.generate(prompts(hf)), engine.generate(prompts(hf))
    print(f"\nhf vs vLLM float32: log-likelihood max |diff| {max(diffs):.1e} over {len(diffs)} requests; "
          f"generations: {[(g.finish_reason, g.text) for g in ours]}")
    assert max(diffs) <= VLLM_LOGPROB_TOL
    assert {g.finish_reason for g in ours} == {"stop", "length"}
    assert ours == theirs


@pytest.mark.engine
def test_a_rerun_of_the_cli_reuses_the_stored_answers(hf_runs):
    (done, first), (_, second) = hf_runs
    assert "evalkit: engine=hf" in done.stderr and "dtype=float32" in done.stderr
    resume = [json.loads((run / "results.json").read_text())["evalkit"]["resume"] for run in (first, second)]
    assert resume[0]["computed"] > 0 and resume[1]["computed"] == 0
    assert resume[1]["reused"] == resume[0]["reused"] + resume[0]["computed"]
    for task in TASKS:
        assert read_samples(first, task) == read_samples(second, task)


@pytest.mark.engine
def test_compare_finds_a_vllm_run_and_an_hf_run_of_one_config_equivalent(noise_pair, hf_runs):
    """The same config (20 documents per task) on both engines, through evalkit.compare: (almost) no document
    differs, so every verdict is equivalent (tolerance 0.35: 20 documents give wide intervals; the noise pair's first
run and the session's HF run, tests/conftest.py)."""
    vllm_dir, ((_, hf_dir), _) = noise_pair[0], hf_runs
    assert json.loads((hf_dir / "results.json").read_text())["evalkit"]["engine"]["name"] == "hf"
    done = subprocess.run([sys.executable, "-m", "evalkit.compare", str(vllm_dir), str(hf_dir), "--tolerance", "0.35"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    accuracy, divergence = done.stdout.split("Divergence (token level)", 1)  # both runs recorded it (the default)
    rows = [line for line in accuracy.splitlines() if line.startswith("| evalkit_")]
    assert rows and all("| equivalent" in row for row in rows), rows
    assert "no noise run: the figures only, no verdict claimed" in divergence  # HF against vLLM: figures only
    same = [a["resps"] == b["resps"] for a, b in zip(read_samples(hf_dir, "evalkit_arith"),
                                                        read_samples(vllm_dir, "evalkit_arith"))]
    assert len(same) == 20 and sum(same) >= 18  # as tests/test_parity.py: 20 here; a near-tie may break apart


BF16_TEXTS = [("The capital of France is", " Paris"), ("2 + 3 =", " 5"), ("Question: What color is the sky?\nAnswer:",
              " The sky is blue."), ("Once upon a time", " there was a princess who lived in a castle")]


@pytest.mark.engine
@pytest.mark.parametrize("batch", [1, 4])
def test_bfloat16_loglikelihoods_equal_lm_evals_hf_backend(embedded_model_dir, batch):
    """In bfloat16 the two differ unless log_softmax runs in the model's dtype and no mask is passed, as
    lm-eval's hf backend does (a float32 log_softmax moved each token by about 1e-2 nats here): one library,
    the same operations on the same inputs, so the numbers must be the same whichever way the processor rounds
    (the next test: another processor's kernels)."""
    from lm_eval.models.huggingface import HFLM

    from evalkit.engine.hf.engine import HFEngine

    ours = HFEngine(model=embedded_model_dir, tokenizer=None, dtype="bfloat16", max_model_len=4096, batch_size=batch,
                    seed=0, trust_remote_code=False, add_bos_token=None, engine_kwargs={})
    theirs = HFLM(pretrained=embedded_model_dir, dtype="bfloat16", device="cpu", batch_size=batch)
    pairs = [(ours.encode(c, add_special_tokens=False), ours.encode(x, add_special_tokens=False)) for c, x in BF16_TEXTS]
    mine = ours.score([ScoreRequest(ids=tuple(c + x), start=len(c)) for c, x in pairs])
    ref = theirs._loglikelihood_tokens([((c, x), ids, cont) for (c, x), (ids, cont) in zip(BF16_TEXTS, pairs)])
    print(f"\nbfloat16, batch {batch}: max |diff| {max(abs(m.logprob - r[0]) for m, r in zip(mine, ref)):.1e}")
    assert [m.logprob for m in mine] == pytest.approx([r[0] for r in ref], abs=1e-6, rel=0)
    assert [m.is_greedy for m in mine] == [r[1] for r in ref]


@pytest.mark.engine
def test_bfloat16_loglikelihoods_equal_lm_evals_hf_backend_under_another_processors_kernels():
    """The test above, both batch sizes, under tests/conftest.py's OTHER_KERNELS in a process of its own (torch
    chooses its kernels once per process)."""
    under_other_kernels(f"{__file__}::test_bfloat16_loglikelihoods_equal_lm_evals_hf_backend")
