"""The ids a run read apart at a reference's top ids (``TokenTrace.given``): the record's given columns (built,
checked, written, read, and an older file without them), the bound with them against the exact KL of full
distributions, and the rule that uses them only where the candidate and the noise runs read them alike.

No engine: the distributions are seeded random ones over a small vocabulary, rounded to float32 as engines give
them; the runs are their records (evalkit/run/divergence_record.py) in folders with a results.json's evalkit section.
Run: pytest tests/test_divergence_given.py
"""

import json
import re

import numpy as np
import pytest
from scipy.special import log_softmax

from evalkit.compare.divergence import between, exact_kl, noise_verdict, records, report
from evalkit.compare.runs import Run
from evalkit.contracts import RequestRecord, ScoreRequest, TokenTrace
from evalkit.run import divergence_record, recording
from evalkit.run.divergence_record import Row

K, VOCAB, N, DOCS = 5, 200, 80, 10


def distributions(seed, spread):
    """n related full distributions (float32 log-probabilities, as float64) and a text token per position."""
    rng = np.random.default_rng(seed)
    ref = log_softmax(rng.normal(size=(N, VOCAB)) * 2.5, axis=1).astype(np.float32).astype(float)
    text = np.array([rng.choice(VOCAB, p=np.exp(r) / np.exp(r).sum()) for r in ref])
    return ref, moved(ref, seed + 1, spread), text


def moved(ref, seed, spread):
    """ref moved by seeded random noise of the given spread in the logits, rounded to float32."""
    rng = np.random.default_rng(seed)
    return log_softmax(ref + rng.normal(size=ref.shape) * spread, axis=1).astype(np.float32).astype(float)


def top(lp):
    """The k best (id, log-probability) entries of one distribution, best first."""
    return tuple((int(t), float(lp[t])) for t in np.argsort(-lp, kind="stable")[:K])


def rows(lp, text, *, read_at=None):
    """One run's record: position i alone in its request, after a prompt of its own (so contexts pair one to
    one); with read_at (a reference's log-probabilities), the ids of its top-k this run's top-k left out."""
    out = []
    for i in range(N):
        own = top(lp[i])
        given = ()
        if read_at is not None:
            mine = {t for t, _ in own}
            given = (tuple((t, float(lp[i][t])) for t, _ in top(read_at[i]) if t not in mine),)
        out.append(Row(i % DOCS, 0, "loglikelihood", 2, (7, 1000 + i, int(text[i])), (float(lp[i][text[i]]),),
                       (own,), given))
    return divergence_record.build(out, K)


def recorded(name, lp, text, *, run_id, read_at=None, reference=None, not_read=""):
    """A run's Recorded as records.read_run makes it; reference: the run whose ids it read (its Recorded)."""
    rec = rows(lp, text, read_at=read_at)
    said = {"read_at": reference.run_id if reference and not not_read else "", "not_read": not_read,
            "reference": reference.run if reference else ""}
    return records.Recorded(f"m/{name}", {"t": rec}, run_id=run_id, **said)


@pytest.fixture(scope="module")
def world():
    ref_lp, cand_lp, text = distributions(0, 1.0)
    noise_lp = moved(ref_lp, 2, 0.3)
    ref = recorded("ref", ref_lp, text, run_id="r-ref")
    return ref_lp, cand_lp, noise_lp, text, ref


def test_with_the_ids_read_apart_the_bound_is_tighter_never_above_the_exact_kl(world):
    ref_lp, cand_lp, _, text, ref = world
    cand = recorded("cand", cand_lp, text, run_id="r-cand", read_at=ref_lp, reference=ref)
    assert cand.given > 0  # the candidate's top-5 misses part of the reference's somewhere
    with_given = between.divergence(ref, cand)
    without = between.divergence(ref, recorded("cand", cand_lp, text, run_id="r-cand"))  # given no reference
    assert with_given.given and not without.given and with_given.notes == ()
    tight, loose = with_given.tasks["t"].contexts, without.tasks["t"].contexts
    order = records.pair(ref.tasks["t"], cand.tasks["t"]).ref  # the compared positions, in key order
    exact = exact_kl(ref_lp, cand_lp)[order]
    assert (tight.kld >= loose.kld - 1e-6).all() and (tight.kld <= exact + 1e-5).all()
    assert tight.kld.mean() > loose.kld.mean() * 1.05
    # the captured mass rises to the reference's own top-5 mass at every position (with the text token's, known
    # on both sides, where it is not among them)
    top_mass = np.array([np.exp(lp[list({t for t, _ in top(lp)} | {int(x)})]).sum()
                         for lp, x in zip(ref_lp, text)])[order]
    assert tight.captured == pytest.approx(top_mass, abs=1e-5)
    assert (loose.captured <= top_mass + 1e-6).all() and loose.captured.mean() < top_mass.mean() - 0.01
    said = report.lines(with_given)
    assert f"- a lower bound: the reference's top-{K}, read on the candidate; it captures " \
           f"{with_given.overall.captured:.3g} of the reference mass" in said[2]
    assert report.lines(without)[2].startswith(f"- a lower bound: top-{K} of both; it captures")


def noise_case(world, *, noise_reads):
    """The candidate read the reference's ids; the noise run (the reference's process, spread 0.3) read them
    or not."""
    ref_lp, cand_lp, noise_lp, text, ref = world
    cand = recorded("cand", cand_lp, text, run_id="r-cand", read_at=ref_lp, reference=ref)
    noise = recorded("noise", noise_lp, text, run_id="r-noise", read_at=ref_lp if noise_reads else None,
                     reference=ref if noise_reads else None)
    found = between.divergence(ref, cand)
    return ref, cand, noise, between.against_noise(found, ref, cand, (ref, noise), alpha=0.01)


def test_a_noise_run_without_the_ids_drops_them_everywhere_in_one_line(world):
    ref, cand, noise, d = noise_case(world, noise_reads=False)
    plain = between.divergence(ref, records.keep_given(cand, frozenset()))
    assert not d.given and d.bound == f"top-{K} of both"
    assert np.array_equal(d.tasks["t"].contexts.kld, plain.tasks["t"].contexts.kld)  # the table too
    said = [n for n in d.notes if "read apart" in n]
    assert said == ["the ids read apart at a reference's top ids are left out on every side, so that the bound "
                    "is the same on each: run m/noise read none"]
    assert sum("read apart" in line for line in report.lines(d)) == 1
    # the noise divergence is the bound of the noise run's own top-5 too
    bare = between.per_document(between.compare_records(ref, noise, K))
    assert d.noise == bare


def test_a_tighter_bound_on_the_candidate_alone_would_call_the_noise_itself_beyond_noise(world):
    """Candidate and noise run of one process (each the reference moved by noise of spread 1): with the
    candidate's ids read apart and the noise run's own top-k alone, every document would look further moved;
    the rule compares both on their top-k, and the verdict is within noise."""
    ref_lp, _, _, text, ref = world
    cand = recorded("cand", moved(ref_lp, 15, 1.0), text, run_id="r-cand", read_at=ref_lp, reference=ref)
    noise = recorded("noise", moved(ref_lp, 16, 1.0), text, run_id="r-noise")
    d = between.against_noise(between.divergence(ref, cand), ref, cand, (ref, noise), alpha=0.01)
    assert d.verdict.label == "within noise" and not d.given
    one_sided = noise_verdict(between.per_document(between.compare_records(ref, cand, K)), d.noise, alpha=0.01)
    assert (one_sided.label, one_sided.p_value) == ("beyond noise", 2 ** -10)  # all 10 documents further


def test_a_noise_run_that_read_the_ids_keeps_them_on_both_sides(world):
    ref, cand, noise, d = noise_case(world, noise_reads=True)
    assert d.given and not [n for n in d.notes if "read apart" in n]
    assert d.documents == between.divergence(ref, cand).documents
    assert d.noise == between.per_document(between.compare_records(ref, noise, K))  # with its ids read apart
    assert d.noise != between.per_document(between.compare_records(ref, records.keep_given(noise, frozenset()), K))


def test_the_two_run_noise_form_is_fair_where_the_second_read_the_first(world):
    """--noise A B, as evalkit.compare.noise makes them: B read A's top ids. And B read some other run's: none."""
    ref_lp, cand_lp, noise_lp, text, ref = world
    cand = recorded("cand", cand_lp, text, run_id="r-cand", read_at=ref_lp, reference=ref)
    first = recorded("first", ref_lp, text, run_id="r-first")
    second = recorded("second", noise_lp, text, run_id="r-second", read_at=ref_lp, reference=first)
    kept, note = records.given_policy(ref, cand, (first, second))
    assert kept == {"m/cand", "m/second"} and note == ""
    other = recorded("second", noise_lp, text, run_id="r-second", read_at=ref_lp, reference=cand)
    kept, note = records.given_policy(ref, cand, (first, other))
    assert kept == frozenset() and note.endswith("run m/second read those of m/cand, not m/first's, nor did both "
                                                 "read m/ref's")


@pytest.mark.parametrize("how, said", [
    ({"reference": "other"}, "run m/cand read those of m/other, not m/ref's"),
    ({"not_read": "this server gives no log-probabilities of given ids"},
     "run m/cand's engine read none (this server gives no log-probabilities of given ids)")])
def test_a_candidate_that_read_another_runs_ids_or_none_is_bounded_on_its_top_k(world, how, said):
    ref_lp, cand_lp, _, text, ref = world
    other = recorded("other", ref_lp, text, run_id="r-other")
    reference = other if "reference" in how else ref
    cand = recorded("cand", cand_lp, text, run_id="r-cand", read_at=ref_lp, reference=reference,
                    not_read=how.get("not_read", ""))
    d = between.divergence(ref, cand)
    assert not d.given and [n for n in d.notes if "read apart" in n][0].endswith(said)


def run_folder(path, name, rows_by_task, evalkit):
    """A run folder holding the records and a results.json naming them (evalkit: the rest of its section)."""
    folder = path / "m" / name
    folder.mkdir(parents=True)
    names = {}
    for task, rec in rows_by_task.items():
        names[task] = f"divergence_{task}.npz"
        divergence_record.write(folder / names[task], rec)
    results = {"evalkit": {**evalkit, "files": {"divergence": names}}}
    (folder / "results.json").write_text(json.dumps(results))
    return Run(folder, results, {})


def test_read_run_takes_the_reference_from_results_json(world, tmp_path):
    ref_lp, cand_lp, _, text, _ = world
    ref = records.read_run(run_folder(tmp_path, "ref", {"t": rows(ref_lp, text)}, {"run_id": "r-ref"}))
    said = {"run": "m/ref", "run_id": "r-ref", "ids_read": 12}
    cand = records.read_run(run_folder(tmp_path, "cand", {"t": rows(cand_lp, text, read_at=ref_lp)},
                                       {"run_id": "r-cand", "divergence": {"top_k": K, "reference": said}}))
    assert (ref.run_id, ref.read_at, cand.run_id, cand.read_at, cand.reference) == ("r-ref", "", "r-cand",
                                                                                     "r-ref", "m/ref")
    assert between.divergence(ref, cand).given
    unread = records.read_run(run_folder(tmp_path, "unread", {"t": rows(cand_lp, text)}, {
        "run_id": "r-u", "divergence": {"reference": {"run": "m/ref", "run_id": "r-ref", "not_read": "no ids"}}}))
    assert (unread.read_at, unread.not_read) == ("", "no ids")


def test_the_record_round_trips_with_and_without_the_given_columns(world, tmp_path):
    ref_lp, cand_lp, _, text, _ = world
    for name, rec in (("with", rows(cand_lp, text, read_at=ref_lp)), ("without", rows(cand_lp, text))):
        divergence_record.write(tmp_path / f"{name}.npz", rec)
        back = divergence_record.read(tmp_path / f"{name}.npz")
        for column in divergence_record.COLUMNS + divergence_record.GIVEN:
            assert np.array_equal(getattr(back, column), getattr(rec, column), equal_nan=True), column
            assert getattr(back, column).dtype == divergence_record.DTYPES[column]
        assert back.given_ids.shape == (N, rec.g) and (rec.g > 0) == (name == "with")
    assert divergence_record.read(tmp_path / "without.npz").given_logprobs.shape == (N, 0)


def test_an_older_file_without_the_given_columns_reads_as_n_by_0(world, tmp_path):
    ref_lp, _, _, text, _ = world
    rec = rows(ref_lp, text)
    with open(tmp_path / "old.npz", "wb") as f:  # what write() wrote before the given columns
        np.savez_compressed(f, version=np.asarray(1), **{c: getattr(rec, c) for c in divergence_record.COLUMNS})
    old = divergence_record.read(tmp_path / "old.npz")
    assert old.given_ids.shape == old.given_logprobs.shape == (N, 0) and old.g == 0
    assert old.given_ids.dtype == np.int32 and old.given_logprobs.dtype == np.float32
    assert between.compare_task(old, old).contexts.kld.tolist() == [0.0] * N


def row(given, top=((40, -0.5), (41, -1.5))):
    return Row(0, 0, "loglikelihood", 2, (5, 6, 40, 41), (-0.5, -1.0), (top, ((41, -1.0),)), given)


def test_given_columns_are_padded_to_the_most_any_position_holds():
    rec = divergence_record.build([row((((50, -3.0), (51, -4.0)), ())), row(())], 2)
    assert rec.g == 2 and rec.given_ids.tolist() == [[50, 51], [-1, -1], [-1, -1], [-1, -1]]
    assert np.isnan(rec.given_logprobs[1:]).all() and rec.given_logprobs[0].tolist() == [-3.0, -4.0]


@pytest.mark.parametrize("given, message", [
    ((((50, -3.0),),), "2 positions but 1 lists of ids read apart"),
    ((((50, -3.0), (50, -4.0)), ()), "repeat one or hold a negative id"),
    ((((-1, -3.0),), ()), "repeat one or hold a negative id"),
    ((((41, -1.5),), ()), "ids read apart [41] are among its own top entries"),
    ((((50, 0.2),), ()), "has the value 0.2, not a log-probability"),
    ((((50, float("nan")),), ()), "has the value nan, not a log-probability")])
def test_given_entries_are_checked_as_built(given, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        divergence_record.build([row(given)], 2)


def test_recording_carries_a_traces_given_entries_into_the_rows():
    trace = TokenTrace(logprobs=(-0.5, -1.0), top=(((40, -0.5),), ((41, -1.0),)), given=(((50, -3.0),), ()))
    record = RequestRecord(kind="loglikelihood", prompt_tokens=2,
                           traced=[(0, ScoreRequest(ids=(5, 6, 40, 41), start=2), trace)])
    rows_of = recording.task_rows({("t", 0): [record]})["t"]
    assert rows_of[0].given == trace.given
    built = recording.task_positions({("t", 0): [record]}, 1)["t"]
    assert built.given_ids.tolist() == [[50], [-1]]
