"""`python -m evalkit.compare REF CAND [--noise RUN]` with both runs' divergence records: the table against a
hand computation, the positions compared (same context only, a shared context once), the one line where a
record is missing or the top-k differ, the verdict against a noise run with exit codes 0 / 1 / 2, the page's
section and --locate's highest-KLD position.

The runs are real run folders made through lm-eval with the fake engine (tests/test_compare.py's fake_run);
their records are written with evalkit.run.divergence_record and named in results.json, as a run names them. Every
record here has, per document of evalkit_facts, two choices (tokens 40 and 50, then 41) after a prompt of the
document's own, so the first continuation position is one context shared by both choices; and per document of
evalkit_arith a generation (60, 61 in the reference) that parts at its second token when told to.
Run: pytest tests/test_compare_divergence.py
"""

import json
import math
import shutil
from html.parser import HTMLParser

import pytest

from evalkit.compare import cli
from evalkit.compare.pages import html_page
from evalkit.compare.divergence import between, records, verdict
from evalkit.compare.runs import load_run
from evalkit.run import divergence_record
from evalkit.run.divergence_record import Row
from tests.fake_engine import FakeEngine
from tests.test_compare import fake_run

DOCS = range(12)
ln = math.log


def facts_rows(shift=lambda d: 0.0, *, k=2, prompt_of=lambda d: (1, 2, 3, 100 + d)):
    """At the shared first position the reference's top is 40 (0.6), 50 (0.3); shift(d) moves mass from 40 to
    50. The second position (after 40 or after 50) is 41 at 0.9, 42 at 0.05 in every run."""
    out = []
    for d in DOCS:
        prompt, s = prompt_of(d), shift(d)
        first = ((40, ln(0.6 - s)), (50, ln(0.3 + s)), (60, ln(0.05)))[:k]
        second = ((41, ln(0.9)), (42, ln(0.05)), (43, ln(0.01)))[:k]
        for request, head in enumerate((40, 50)):
            out.append(Row(d, request, "loglikelihood", len(prompt), prompt + (head, 41),
                           (dict(first)[head], ln(0.9)), (first, second)))
    return out


def arith_rows(*, part=False, k=2):
    """A generation 60, 61 (the candidate's, with part, 60, 70: it parts at the second token, where the
    reference gives 61 0.7, 70 0.2 and the candidate 70 0.6, 61 0.3)."""
    out = []
    for d in DOCS:
        prompt = (5, 6, 200 + d)
        first = ((60, ln(0.8)), (62, ln(0.1)), (63, ln(0.01)))[:k]
        second = (((70, ln(0.6)), (61, ln(0.3)), (63, ln(0.01))) if part else
                  ((61, ln(0.7)), (70, ln(0.2)), (63, ln(0.01))))[:k]
        text = (60, 70) if part else (60, 61)
        out.append(Row(d, 0, "generate_until", len(prompt), prompt + text, (ln(0.8), dict(second)[text[1]]),
                       (first, second)))
    return out


def record(run, rows_by_task, k=2):
    """Write each task's record into the run folder and name it in results.json, as a run does; None: a run
    without one (divergence_top_k=0, or made before runs recorded it)."""
    data = json.loads((run / "results.json").read_text())
    for name in data["evalkit"].get("files", {}).pop("divergence", {}).values():
        (run / name).unlink()
    names = {}
    for task, rows in (rows_by_task or {}).items():
        names[task] = f"divergence_{task}_2026-01-01T00-00-00.npz"
        divergence_record.write(run / names[task], divergence_record.build(rows, k))
    if names:
        data["evalkit"].setdefault("files", {})["divergence"] = names
    (run / "results.json").write_text(json.dumps(data))
    return run


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One real run of evalkit_arith and evalkit_facts (12 documents each); each test copies it. float32: the
    default noise floor of --locate fits it."""
    return fake_run(tmp_path_factory.mktemp("base"), "m", FakeEngine(), dtype="float32")


@pytest.fixture
def make(base, tmp_path):
    def copy(name, rows_by_task=None, k=2):
        run = tmp_path / "m" / name
        shutil.copytree(base, run)
        return record(run, rows_by_task, k)
    return copy


SHIFTED = 0.2
KL_FIRST = 0.6 * ln(0.6 / 0.4) + 0.3 * ln(0.3 / 0.5)  # the rest (0.1 on both sides) adds 0


def test_the_table_is_the_hand_computation(make, capsys):
    ref = make("ref", {"evalkit_facts": facts_rows()})
    cand = make("cand", {"evalkit_facts": facts_rows(lambda d: SHIFTED)})
    d = between.divergence(records.read_run(load_run(ref)), records.read_run(load_run(cand)))
    s = d.per_task["evalkit_facts"]
    # three contexts per document: the shared first position, after 40, after 50; only the first moved
    assert (s.documents, s.positions, d.tasks["evalkit_facts"].texts.n) == (12, 36, 48)
    # within the rest term's rounding margin (bound.rounding_margin: the candidate's rest read 1.3e-6 larger)
    assert s.mean_kld.value == pytest.approx(KL_FIRST / 3, abs=2e-6)
    assert s.kld_percentiles["Maximum"] == pytest.approx(KL_FIRST, abs=2e-6) and s.kld_percentiles["Median"] == 0
    assert s.same_top.value == pytest.approx(2 / 3)  # 0.4 < 0.5: the candidate's top is 50 at the first position
    assert s.captured == pytest.approx((0.9 + 0.95 + 0.95) / 3, rel=1e-6)
    # Δp over the four (context, token) positions: -0.2 (40), +0.2 (50), 0, 0
    assert s.mean_dp.value == pytest.approx(0, abs=1e-7)
    assert s.rms_dp.value == pytest.approx(SHIFTED / math.sqrt(2), rel=1e-6)
    assert s.ppl_ratio.value == pytest.approx(math.exp(-(ln(0.4 / 0.6) + ln(0.5 / 0.3)) / 4), rel=1e-6)
    assert cli.main([str(ref), str(cand)]) == 0  # identical samples: the rows pass, and no verdict is claimed
    out = capsys.readouterr().out
    assert "## Divergence (token level)" in out
    row = next(line for line in out.splitlines() if line.startswith("| evalkit_facts | 12 | 36 |"))
    assert f"| {KL_FIRST / 3:.4g} ± " in row and f"| {KL_FIRST:.3g} |" in row and "| 66.667 ± " in row
    assert "- a lower bound: top-2 of both; it captures 0.933 of the reference mass" in out
    assert "36 in 12 documents (log-likelihood continuations 36)" in out
    assert "no noise run: the figures only, no verdict claimed" in out


def test_only_positions_with_the_same_context_are_compared(make):
    """Document 0's prompt differs in the candidate: none of its positions is compared. The generation parts at
    its second token: that position counts for KLD and top-1 (same context), not for Δp (other tokens), and
    nothing after it."""
    ref = make("ref", {"evalkit_facts": facts_rows(), "evalkit_arith": arith_rows()})
    cand = make("cand", {"evalkit_facts": facts_rows(prompt_of=lambda d: (1, 2, 3, 999 if d == 0 else 100 + d)),
                         "evalkit_arith": arith_rows(part=True)})
    d = between.divergence(records.read_run(load_run(ref)), records.read_run(load_run(cand)))
    facts, arith = d.per_task["evalkit_facts"], d.per_task["evalkit_arith"]
    assert (facts.documents, facts.positions, d.tasks["evalkit_facts"].texts.n) == (11, 33, 44)
    assert 0 not in d.tasks["evalkit_facts"].docs
    assert (arith.positions, d.tasks["evalkit_arith"].texts.n) == (24, 12)
    parting = 0.7 * ln(0.7 / 0.3) + 0.2 * ln(0.2 / 0.6)
    assert arith.kld_percentiles["Maximum"] == pytest.approx(parting, abs=2e-6)  # within the rounding margin
    assert arith.same_top.value == pytest.approx(0.5) and arith.mean_dp.value == pytest.approx(0, abs=1e-7)
    assert d.overall.positions == 33 + 24


def test_a_shared_context_counts_once_and_a_repeated_token_once(make):
    """Rows repeated in a record (the same context and token twice) and the choices' shared first position
    are one position each."""
    twice = facts_rows()
    ref = make("ref", {"evalkit_facts": twice + twice[:2]})
    cand = make("cand", {"evalkit_facts": facts_rows(lambda d: SHIFTED)})
    d = between.divergence(records.read_run(load_run(ref)), records.read_run(load_run(cand)))
    assert (d.overall.positions, d.tasks["evalkit_facts"].texts.n) == (36, 48)
    assert d.overall.mean_kld.value == pytest.approx(KL_FIRST / 3, abs=2e-6)  # within the rounding margin


def test_no_common_token_at_a_parting_position_is_a_zero_bound_and_a_different_top():
    ref = divergence_record.build([Row(0, 0, "generate_until", 2, (5, 6, 61), (ln(0.7),), (((61, ln(0.7)),),))], 1)
    cand = divergence_record.build([Row(0, 0, "generate_until", 2, (5, 6, 70), (ln(0.6),), (((70, ln(0.6)),),))], 1)
    task = between.compare_task(ref, cand)
    assert task.unshared == 1 and task.contexts.kld.tolist() == [0.0] and task.contexts.same_top.tolist() == [0.0]
    assert task.texts.n == 0


@pytest.mark.parametrize("lacking", ["ref", "cand"])
def test_a_run_without_a_record_gets_one_line(make, lacking, capsys):
    runs = {"ref": make("ref", None if lacking == "ref" else {"evalkit_facts": facts_rows()}),
            "cand": make("cand", None if lacking == "cand" else {"evalkit_facts": facts_rows()})}
    assert cli.main([str(runs["ref"]), str(runs["cand"])]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("Divergence")]
    assert lines == [f"Divergence: none: run m/{lacking} recorded no divergence; run it with divergence_top_k=20 "
                     "to record one"]
    assert "## Divergence" not in out


def test_unequal_top_k_is_said_in_one_line_and_compared_at_the_smaller(make, capsys):
    ref = make("ref", {"evalkit_facts": facts_rows(k=3)}, k=3)
    cand = make("cand", {"evalkit_facts": facts_rows(lambda d: SHIFTED)})
    assert cli.main([str(ref), str(cand)]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "the runs recorded top-" in line]
    assert said == ["- the runs recorded top-3 (m/ref) and top-2 (m/cand): compared at top-2, the larger records "
                    "cut to their best"]
    assert "top-2 of both; it captures 0.933" in out and f"| {KL_FIRST / 3:.4g} ± " in out  # as if both were top-2


def noise_case(make, noise_shift):
    """A reference, a candidate that moves document d by 0.05 + 0.01 d, and a noise run moving each by
    noise_shift(d) (None: a noise run without a record)."""
    ref = make("ref", {"evalkit_facts": facts_rows()})
    cand = make("cand", {"evalkit_facts": facts_rows(lambda d: 0.05 + 0.01 * d)})
    noise = make("noise", None if noise_shift is None else {"evalkit_facts": facts_rows(noise_shift)})
    return ref, cand, noise


def test_within_noise_exits_0(make, capsys):
    """The noise run moves the documents as far, in the reverse order: no side is further."""
    ref, cand, noise = noise_case(make, lambda d: 0.05 + 0.01 * (11 - d))
    assert cli.main([str(ref), str(cand), "--noise", str(noise)]) == 0
    out = capsys.readouterr().out
    assert "- against the noise run: **within noise** (exit 0)" in out and "signed-rank test over 12 of 12" in out


def test_beyond_noise_exits_1_though_every_row_passes(make, capsys):
    """The noise run is the reference's process exactly (divergence 0): every document moved further."""
    ref, cand, noise = noise_case(make, lambda d: 0.0)
    assert cli.main([str(ref), str(cand), "--noise", str(noise)]) == 1
    out = capsys.readouterr().out
    assert "**beyond noise** (exit 1)" in out and f"p={2 ** -12:.3g}" in out
    # the two-run form: the second noise run against the first, here the same pair
    assert cli.main([str(ref), str(cand), "--noise", str(ref), str(noise)]) == 1
    capsys.readouterr()


def test_too_few_documents_for_the_alpha_is_unusable_exit_2(make, capsys):
    ref, cand, noise = noise_case(make, lambda d: 0.0)
    assert cli.main([str(ref), str(cand), "--noise", str(noise), "--divergence-alpha", "0.0001"]) == 2
    assert "cannot reach alpha=0.0001 with fewer than 14" in capsys.readouterr().err
    html = (cand / "compare-vs-m-ref.html").read_text()
    assert "divergence verdict unusable" in html and "(exit 2)" in html


def test_a_noise_run_without_a_record_is_unusable_exit_2_in_one_line(make, capsys):
    ref, cand, noise = noise_case(make, None)
    assert cli.main([str(ref), str(cand), "--noise", str(noise)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evalkit.compare: error: the divergence of m/cand against noise: "
                                               "run m/noise recorded no divergence"), err
    assert "**unusable** (exit 2)" in captured.out


def test_a_candidate_without_a_record_against_a_noise_pair_is_unusable_exit_2_in_one_line(make, capsys):
    """--noise asks for the divergence verdict: a candidate that recorded none cannot get it, and that is said,
    not skipped (it printed "none" and exited 0). Where no run recorded one, --noise is the accuracy noise only."""
    ref = make("ref", {"evalkit_facts": facts_rows()})
    cand = make("cand", None)
    noise = make("noise", {"evalkit_facts": facts_rows(lambda d: 0.01)})
    assert cli.main([str(ref), str(cand), "--noise", str(noise)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evalkit.compare: error: the divergence of m/cand against noise: "
                                               "run m/cand recorded no divergence"), err
    assert "Divergence: none: run m/cand recorded no divergence" in captured.out
    assert "**unusable** (exit 2)" in captured.out
    bare = [make(name, None) for name in ("ref0", "cand0", "noise0")]
    assert cli.main([str(bare[0]), str(bare[1]), "--noise", str(bare[2])]) == 0
    assert "Divergence: none: neither run" in capsys.readouterr().out


@pytest.mark.parametrize("documents, candidates, usable", [(7, 1, True), (7, 2, False), (8, 2, True),
                                                           (8, 3, False), (9, 3, True), (10, 20, False), (11, 20, True)])
def test_too_few_documents_for_the_family_s_adjustment_are_unusable(documents, candidates, usable):
    """Every document moved further on every candidate: p = 2^-N each. Alone, 7 documents reach 0.01; with m
    candidates Holm's smallest adjusted p is m 2^-N, so the family needs min_documents(alpha / m) (8 for 2 or 3,
    11 for 20), and a candidate below it is unusable, not within noise."""
    p = 2.0 ** -documents
    each = verdict.NoiseVerdict("beyond noise", p, 0.01, documents, documents, 1.0, 0.0, "t")
    adjusted = verdict.family([each] * candidates, alpha=0.01)
    assert {v.label for v in adjusted} == ({"beyond noise"} if usable else {"unusable"}), adjusted[0].reason
    if not usable:
        assert f"fewer than the {verdict.min_documents(0.01 / candidates)} that {candidates} candidates" in \
            adjusted[0].reason


def test_bad_noise_options_are_refused(make, capsys):
    ref, cand, noise = noise_case(make, lambda d: 0.0)
    assert cli.main([str(ref), str(cand), "--noise", str(noise), str(noise), str(noise)]) == 2
    assert cli.main([str(ref), str(cand), "--noise", str(noise), "--divergence-alpha", "0.7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--noise takes one run" in err[0] and "--divergence-alpha 0.7" in err[1]


def test_several_candidates_are_one_family():
    def v(p):
        return verdict.NoiseVerdict("beyond noise" if p <= 0.01 else "within noise", p, 0.01, 12, 12, 1.0, 0.5, "t")

    adjusted = verdict.family([v(0.006), v(0.009)], alpha=0.01)  # each alone beyond; Holm: 0.012, 0.012
    assert [x.label for x in adjusted] == ["within noise", "within noise"]
    assert "Holm-adjusted over 2 candidates: p=0.012" in adjusted[0].reason
    assert [x.label for x in verdict.family([v(0.004), v(0.5)], alpha=0.01)] == ["beyond noise", "within noise"]
    assert [x.label for x in verdict.family([v(0.004), v(0.008)], alpha=0.01)] == ["beyond noise", "beyond noise"]
    unusable = verdict.NoiseVerdict("unusable", math.nan, 0.01, 3, 0, 1.0, 0.5, "few")
    assert verdict.family([v(0.006), unusable], alpha=0.01)[0].label == "beyond noise"  # a family of one tested
    assert verdict.family([v(0.004)], alpha=0.01)[0].label == "beyond noise"


class Sections(HTMLParser):
    """The h2 headings and the figure titles of a page, in order."""

    def __init__(self):
        super().__init__()
        self.titles, self._in = [], None

    def handle_starttag(self, tag, attrs):
        self._in = tag if tag in ("h2", "h3") else None

    def handle_data(self, data):
        if self._in:
            self.titles.append((self._in, data.strip()))
            self._in = None


def test_the_page_has_the_divergence_section_after_the_verdict(make):
    ref, cand, noise = noise_case(make, lambda d: 0.0)
    cli.main([str(ref), str(cand), "--noise", str(noise)])
    html = (cand / "compare-vs-m-ref.html").read_text()
    headline = html.split('id="verdict">')[1].split("</p>")[0]
    assert "divergence beyond noise (p=0.000244)" in headline and headline.endswith("(exit 1)")
    parser = Sections()
    parser.feed(html)
    order = [title for _, title in parser.titles]
    at = order.index("Divergence (token level)")
    assert order[at + 1:at + 3] == ["Divergence: KLD percentiles", "Divergence: candidate and noise per document"]
    assert order.index("The text report") > at and html.index('id="verdict"') < html.index("id=divergence")
    assert html.count("data:image/png;base64,") >= 2 and "12 lie above the diagonal" in html


def test_the_headline_says_the_divergence_verdict():
    import pandas as pd

    table = pd.DataFrame({"task": ["t"], "filter": ["none"], "metric": ["acc"], "n": [12], "method": ["tango"],
                          "verdict": ["inconclusive"]})
    beyond = verdict.NoiseVerdict("beyond noise", 0.0002, 0.01, 12, 12, 0.1, 0.0, "t")
    words, kind = html_page.headline(table, exit_code=1, needed=149, noise=beyond)
    assert words.endswith("; divergence beyond noise (p=0.0002) (exit 1)") and kind == "fail"
    words, _ = html_page.headline(table, exit_code=1, needed=149, noise=verdict.NoiseVerdict(
        "within noise", 0.3, 0.01, 12, 12, 0.1, 0.1, "t"))
    assert words.endswith("(exit 1: another candidate is worse or beyond noise)")


def test_locate_links_a_changed_choice_to_its_highest_kld_position(make, capsys):
    """Document 3's chosen answer changes in the candidate's samples (no engine: a log-likelihood document);
    its highest-KLD position is the shared first position (request 0, position 4)."""
    ref = make("ref", {"evalkit_facts": facts_rows()})
    cand = make("cand", {"evalkit_facts": facts_rows(lambda d: SHIFTED)})
    samples = json.loads((cand / "results.json").read_text())["evalkit"]["files"]["samples"]["evalkit_facts"]
    lines = [json.loads(line) for line in (cand / samples).read_text().splitlines()]
    for sample in lines:
        if sample["doc_id"] == 3:
            lls = [float(r[0][0]) for r in sample["resps"]]  # lm-eval writes them as text
            sample["resps"][max(range(len(lls)), key=lls.__getitem__)][0][0] = str(min(lls) - 10.0)  # another wins
    (cand / samples).write_text("\n".join(json.dumps(s) for s in lines) + "\n")
    assert cli.main([str(ref), str(cand), "--locate"]) == 0
    out = capsys.readouterr().out
    assert "### The highest-KLD position of each changed document" in out
    peaks = out.split("### The highest-KLD position of each changed document")[1].split("\n\n")[1].splitlines()
    assert peaks[0].startswith("| task | doc | class | request | position | kind | KLD |") and len(peaks) == 3
    row = peaks[2]
    assert row.startswith("| evalkit_facts | 3 |")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:7] == ["0", "4", "log-likelihood continuations", f"{KL_FIRST:.4g}"]
    assert cells[7:] == ["'#40'", "'#40'"]


def test_positions_whose_entries_hold_more_than_all_the_mass_are_left_out_of_every_figure_in_one_line():
    """A bfloat16 log_softmax puts up to 1.005 of probability on a top-20; where the candidate's entries hold
    more than all of it (documents 0-5 here, 1.3), the position is no distribution: it is left out of the KLD,
    top-1 and Δp figures alike, counted, and named in one line; the other documents' figures are those of the
    same runs without the overfull documents."""
    def overfull(d):
        return d < 6

    over = [Row(d, 0, "loglikelihood", 2, (5, 6, 40), (ln(0.8),), (((40, ln(0.8)), (41, ln(0.5))),))
            if overfull(d) else Row(d, 0, "loglikelihood", 2, (5, 6, 40), (ln(0.7),), (((40, ln(0.7)), (41, ln(0.2))),))
            for d in DOCS]
    fine = [Row(d, 0, "loglikelihood", 2, (5, 6, 40), (ln(0.8),), (((40, ln(0.8)), (41, ln(0.1))),)) for d in DOCS]
    ref = records.Recorded("m/ref", {"t": divergence_record.build(fine, 2)})
    cand = records.Recorded("m/cand", {"t": divergence_record.build(over, 2)})
    d = between.divergence(ref, cand)
    assert [n for n in d.notes if "sum above 1" in n] == [
        "6 positions left out of every figure: their top-k probabilities sum above 1 there (run m/cand's up to "
        "1.3), so they are not the log-probabilities of one distribution and no bound holds at them"]
    assert d.overall.positions == 6 and d.overall.documents == 6
    kept = [r for r in fine if not overfull(r.doc_id)], [r for r in over if not overfull(r.doc_id)]
    alone = between.divergence(records.Recorded("m/ref", {"t": divergence_record.build(kept[0], 2)}),
                               records.Recorded("m/cand", {"t": divergence_record.build(kept[1], 2)}))
    assert d.overall.mean_kld == alone.overall.mean_kld and d.overall.mean_dp == alone.overall.mean_dp
    assert not any("sum above 1" in n for n in alone.notes)
    every = between.divergence(ref, records.Recorded("m/cand", {"t": divergence_record.build(
        [r for r in over if overfull(r.doc_id)], 2)}))
    assert every.missing.startswith("6 positions left out of every figure")  # none left: no table


def test_ids_read_apart_enter_the_bound_capped_at_the_last_top_entry_or_not_where_they_overfill_the_row():
    """An id read in another engine call may round above the last top entry that left it out (bfloat16); the
    bound takes it at that entry. Where even capped values take the row's entries above all the mass, the row
    keeps its own entries: a bound from one distribution."""
    rows = divergence_record.build([Row(0, 0, "loglikelihood", 2, (5, 6, 40, 41), (ln(0.5), ln(0.6)),
                                (((40, ln(0.5)), (41, ln(0.2))), ((41, ln(0.6)), (42, ln(0.3)))),
                                (((43, ln(0.21)),), ((44, ln(0.2)),)))], 2)
    settled, most = records.as_distributions(rows)
    assert settled.given_ids.tolist() == [[43], [-1]]  # 0.6 + 0.3 + 0.2 > 1: the second row keeps its own
    assert settled.given_logprobs[0, 0] == pytest.approx(ln(0.2))  # 0.21, read apart, enters at 0.2
    assert len(settled) == 2 and most <= 1 + records.MASS_SLACK  # both rows distributions


def outputs(rows, doc):
    """A document's generated ids as a run recorded them: its text tokens in position order."""
    at = rows.doc_id == doc
    return rows.text_id[at][rows.position[at].argsort()].tolist()


def test_runs_that_record_their_divergence_are_compared_as_written(tmp_path, capsys):
    """Two runs that wrote their own records (divergence_top_k=20, the fake engine's traces), the candidate
    answering ' 13' to every question. The log-likelihoods are the same: KLD 0 everywhere. Each generation is
    compared up to and including the token where the two outputs part, counted here from the ids each run
    recorded, apart from the context keys compare matches on."""
    ref = fake_run(tmp_path, "a", FakeEngine(), divergence_top_k=20, dtype="float32")
    cand = fake_run(tmp_path, "b", FakeEngine(reply=" 13"), divergence_top_k=20, dtype="float32")
    r, c = records.read_run(load_run(ref)), records.read_run(load_run(cand))
    assert not r.missing and r.k == c.k == 20
    d = between.divergence(r, c)
    facts, rows = d.per_task["evalkit_facts"], r.tasks["evalkit_facts"]
    assert facts.positions == len(set(zip(rows.doc_id, rows.context))) < len(rows)  # choices share a context
    assert d.tasks["evalkit_facts"].texts.n == len(set(zip(rows.doc_id, rows.context, rows.text_id)))
    assert (facts.mean_kld.value, facts.same_top.value, facts.mean_dp.value) == (0.0, 1.0, 0.0)
    shared = parted = 0
    for doc in DOCS:
        a, b = outputs(r.tasks["evalkit_arith"], doc), outputs(c.tasks["evalkit_arith"], doc)
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shared += min(common + 1, len(a), len(b))
        parted += min(common, len(a), len(b))
    assert d.per_task["evalkit_arith"].positions == shared and d.tasks["evalkit_arith"].texts.n == parted
    assert shared > parted  # some outputs parted
    assert cli.main([str(ref), str(cand)]) == 1  # arith is worse
    out = capsys.readouterr().out
    assert f"generated up to the first parting {shared}" in out and "top-20 of both; it captures" in out
