"""Why did a document's answer change? The pure half of ``--locate``; evalkit/compare/locate/passes.py runs the engines.

For a generation that differs between two runs, each run's engine teacher-forces both outputs after the
shared prompt (:class:`~evalkit.contracts.TokenTrace`). From those four traces: the first divergent token,
each engine's margin between the two tokens there, how far the candidate engine's log-probabilities had
moved from the reference engine's on the shared tokens before it (the drift), and the class of the flip:

* ``near-tie``: the reference engine was nearly indifferent between the two tokens, and the candidate's
  engine prefers its own by no more: noise any engine can show;
* ``logit drift``: not a tie, and the candidate engine's log-probabilities had moved beyond the noise floor
  before the divergence (the candidate computes a different function: dtype, weights, kernels);
* ``other``: neither (e.g. an output that ends where the other goes on, or a flip the teacher-forced
  engines do not reproduce).

For log-likelihood tasks the same from the per-choice log-likelihoods both runs recorded: no engine needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from evalkit.contracts import ScoreRequest, TokenTrace
from evalkit.run import sample_index

NEAR_TIE = 0.1
"""Nats: two tokens this close on both engines are a coin flip for any engine. Their probabilities are then
within 10% of each other (e^0.1 = 1.105), and an engine in reduced precision moves log-probabilities that
much on its own: bfloat16 keeps 8 significant bits (a logit near 16 is rounded in steps of 0.125), and
measured here, bfloat16 against float32 on the embedded model moved the log-probabilities of its arithmetic
prompts by 0.008 nats at the median, 0.07 at the 90th percentile and 0.16 at most (and tied the two tokens
exactly at every flip). ``--near-tie`` changes it."""

NOISE_FLOOR = 1e-4  # applied to CPU float32 runs only (locate.default_floor_applies)
"""Nats: the largest log-probability difference a float32 engine shows on the same requests in another
batch arrangement, as measured in this project (scheduling settings and shuffled request order on the CPU
engine: 2.7e-05 at most, docs/survive.md; the tests allow 1e-4). Drift above it before the
divergence is the candidate computing something else. ``--noise RUN_A RUN_B`` replaces it with what those
two runs show."""

CLASSES = ("near-tie", "logit drift", "other")


def divergence(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """The first index where two output id lists differ (the shorter one's length when one is a prefix of
    the other), or None when they are equal."""
    if list(reference) == list(candidate):
        return None
    return next((i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b),
                min(len(reference), len(candidate)))


def classify(ref_margin: float | None, cand_margin: float | None, drift: float | None, *, near_tie: float,
             floor: float) -> str:
    """near-tie when both engines hold the two tokens within near_tie of each other (the reference nearly
    indifferent, the candidate leaning the other way no further: a coin flip on both sides); else logit
    drift when the shared tokens drifted beyond the floor; else other. Margins are lp(reference's token) -
    lp(candidate's token), None where an output ended."""
    if ref_margin is not None and cand_margin is not None and max(abs(ref_margin), abs(cand_margin)) <= near_tie:
        return "near-tie"
    if drift is not None and drift > floor:
        return "logit drift"
    return "other"


@dataclass(frozen=True)
class Sequences:
    """One differing generation: the prompt both runs sent and each run's output ids."""

    prompt: tuple[int, ...]
    reference: tuple[int, ...]
    candidate: tuple[int, ...]

    def requests(self) -> list[ScoreRequest]:
        """The two prefills each engine runs: the reference's output with the prompt (every position from 1,
        for the drift along the prompt too), the candidate's output after the prompt."""
        return [ScoreRequest(ids=self.prompt + self.reference, start=1),
                ScoreRequest(ids=self.prompt + self.candidate, start=len(self.prompt))]


def generation_record(sample: dict[str, Any]) -> dict[str, Any]:
    """The generate_until request record evalkit merged into a sample (prompt_tokens, output_ids, ...)."""
    return next((r for r in sample.get("requests") or [] if r.get("kind") == "generate_until"), {})


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: a key of locate's engine passes
class Differing:
    """One generation whose output ids differ between two runs, with both runs' samples."""

    task: str
    doc_id: int
    ref: dict[str, Any]
    cand: dict[str, Any]

    def sequences(self, prompt: tuple[int, ...]) -> Sequences:
        return Sequences(prompt=prompt, reference=tuple(generation_record(self.ref)["output_ids"]),
                         candidate=tuple(generation_record(self.cand)["output_ids"]))


def differing(reference: dict[str, dict[Any, dict]],
              candidate: dict[str, dict[Any, dict]]) -> tuple[list[Differing], list[str]]:
    """The generations whose output ids differ, once per document whatever its filters (samples: task ->
    (doc_id, filter) -> sample), and the differing ones that cannot be located, each with why."""
    found, skipped = [], []
    for task in sorted(reference):
        seen: set[int] = set()
        for key in sorted(reference[task]):
            ref, cand = reference[task][key], candidate[task][key]
            if key[0] in seen or ref.get("raw_output") is None:
                continue
            seen.add(key[0])
            ids = [generation_record(s).get("output_ids") for s in (ref, cand)]
            if None in ids:
                if ref.get("raw_output") != cand.get("raw_output"):
                    skipped.append(f"{task} doc {key[0]}: no output_ids recorded (a run made before evalkit kept them)")
            elif ids[0] != ids[1]:
                found.append(Differing(task=task, doc_id=key[0], ref=ref, cand=cand))
    return found, skipped


@dataclass(frozen=True)
class Side:
    """One engine at the first divergent token: its log-probabilities of both tokens, and its top-k there."""

    ref_logprob: float | None  # of the reference's token (None: the reference's output ended)
    cand_logprob: float | None
    top: tuple[tuple[int, float], ...]

    @property
    def margin(self) -> float | None:
        """lp(reference's token) - lp(candidate's token): positive where this engine prefers the reference's."""
        if self.ref_logprob is None or self.cand_logprob is None:
            return None
        return self.ref_logprob - self.cand_logprob


@dataclass(frozen=True)
class Flip:
    """Where and why one generation changed."""

    task: str
    doc_id: int
    index: int  # first divergent output token
    ref_token: int | None  # None: that output ended at index
    cand_token: int | None
    ref_side: Side  # the reference run's engine
    cand_side: Side  # the candidate run's engine
    drift: float | None  # max |cand engine - ref engine| log-prob on the shared tokens (prompt from 1, output < index)
    deltas: tuple[float, ...]  # cand engine - ref engine log-prob of the reference's tokens, positions 1..divergence
    prompt_tokens: int
    kind: str
    prompt_tail: str = ""  # the end of the prompt text, as recorded
    shared_output: str = ""  # the output both runs wrote before the divergence, decoded (filled by locate)
    text: dict[int, str] = field(default_factory=dict)  # token id -> decoded text (filled by locate)

    def token_ids(self) -> set[int]:
        """The tokens the report names: both divergent tokens and both engines' top-k there."""
        named = {t for t in (self.ref_token, self.cand_token) if t is not None}
        return named | {t for s in (self.ref_side, self.cand_side) for t, _ in s.top}

    def token_text(self, token: int | None) -> str:
        return "<end>" if token is None else self.text.get(token, f"#{token}")


def _at(trace: TokenTrace, index: int) -> tuple[float | None, tuple[tuple[int, float], ...]]:
    if 0 <= index < len(trace.logprobs):
        return trace.logprobs[index], trace.top[index]
    return None, ()


def side(seq: Sequences, at: int, traces: tuple[TokenTrace, TokenTrace]) -> Side:
    """One engine's view of output position at, from its traces of (reference, candidate) sequences."""
    on_ref, on_cand = traces
    ref_lp, ref_top = _at(on_ref, len(seq.prompt) + at - 1) if at < len(seq.reference) else (None, ())
    cand_lp, cand_top = _at(on_cand, at) if at < len(seq.candidate) else (None, ())
    return Side(ref_logprob=ref_lp, cand_logprob=cand_lp, top=ref_top or cand_top)


def explain(task: str, doc_id: int, seq: Sequences, *, ref_engine: tuple[TokenTrace, TokenTrace],
            cand_engine: tuple[TokenTrace, TokenTrace], near_tie: float, floor: float,
            prompt_tail: str = "") -> Flip | None:
    """The Flip of one generation from both engines' (reference, candidate) traces; None when equal."""
    at = divergence(seq.reference, seq.candidate)
    if at is None:
        return None
    upto = len(seq.prompt) + min(at + 1, len(seq.reference)) - 1  # positions 1..divergence on the reference's tokens
    deltas = tuple(c - r for r, c in zip(ref_engine[0].logprobs[:upto], cand_engine[0].logprobs[:upto]))
    shared = deltas[:len(seq.prompt) + at - 1]
    drift = max(map(abs, shared)) if shared else None
    ref_side, cand_side = side(seq, at, ref_engine), side(seq, at, cand_engine)
    tokens = [s[at] if at < len(s) else None for s in (seq.reference, seq.candidate)]
    return Flip(task=task, doc_id=doc_id, index=at, ref_token=tokens[0], cand_token=tokens[1], ref_side=ref_side,
                cand_side=cand_side, drift=drift, deltas=deltas, prompt_tokens=len(seq.prompt),
                kind=classify(ref_side.margin, cand_side.margin, drift, near_tie=near_tie, floor=floor),
                prompt_tail=prompt_tail)


@dataclass(frozen=True)
class ChoiceChange:
    """A log-likelihood document whose chosen answer (highest log-likelihood) changed."""

    task: str
    doc_id: int
    ref_choice: int
    cand_choice: int
    ref_margin: float  # reference run: ll(its choice) - ll(the candidate's choice)
    cand_margin: float  # candidate run, the same difference (negative: it prefers its own choice)
    drift: float  # max |cand - ref| log-likelihood over the document's choices
    deltas: tuple[float, ...]  # per choice, cand - ref
    kind: str


def choice_logprobs(sample: dict[str, Any]) -> list[float] | None:
    """Per-choice log-likelihoods lm-eval recorded in a log-likelihood sample's resps; None otherwise."""
    return None if sample.get("raw_output") is not None else sample_index.choice_logprobs(sample) or None


def choice_change(task: str, ref: dict[str, Any], cand: dict[str, Any], *, near_tie: float,
                  floor: float) -> ChoiceChange | None:
    """The ChoiceChange of one document from both runs' samples; None when the chosen answer is the same."""
    a, b = choice_logprobs(ref), choice_logprobs(cand)
    if not a or not b or len(a) != len(b):
        return None
    i, j = max(range(len(a)), key=a.__getitem__), max(range(len(b)), key=b.__getitem__)
    if i == j:
        return None
    deltas = tuple(y - x for x, y in zip(a, b))
    drift = max(map(abs, deltas))
    return ChoiceChange(task=task, doc_id=ref["doc_id"], ref_choice=i, cand_choice=j, ref_margin=a[i] - a[j],
                        cand_margin=b[i] - b[j], drift=drift, deltas=deltas,
                        kind=classify(a[i] - a[j], b[i] - b[j], drift, near_tie=near_tie, floor=floor))


def choice_changes(reference: dict[str, dict[Any, dict]], candidate: dict[str, dict[Any, dict]], *,
                   near_tie: float, floor: float) -> list[ChoiceChange]:
    """Every log-likelihood document whose chosen answer changed, once per document (samples: task -> key)."""
    changes = []
    for task in sorted(set(reference) & set(candidate)):
        seen: set[int] = set()
        for key in sorted(set(reference[task]) & set(candidate[task])):
            if key[0] not in seen:
                seen.add(key[0])
                change = choice_change(task, reference[task][key], candidate[task][key], near_tie=near_tie, floor=floor)
                changes.extend([change] if change else [])
    return changes


def noise_floor(a: dict[str, dict[Any, dict]], b: dict[str, dict[Any, dict]]) -> float | None:
    """The largest per-choice log-likelihood difference between two runs' samples (task -> key -> sample),
    or None when they share no log-likelihood documents."""
    diffs = [abs(y - x) for task in set(a) & set(b) for key in set(a[task]) & set(b[task])
             for x, y in zip(choice_logprobs(a[task][key]) or [], choice_logprobs(b[task][key]) or [])]
    return max(diffs) if diffs else None


@dataclass
class Localisation:
    """Everything --locate found for one candidate against the reference."""

    reference: str
    candidate: str
    flips: list[Flip]
    choices: list[ChoiceChange]
    near_tie: float
    floor: float
    floor_source: str
    skipped: list[str] = field(default_factory=list)  # documents not located, each with why
    engines: dict[str, str] = field(default_factory=dict)  # side -> what ran it
    seconds: dict[str, float] = field(default_factory=dict)  # engine starts, traces, total

    def counts(self) -> dict[str, dict[str, int]]:
        """Per kind of document (generations, choices), documents per class."""
        return {"generations": {k: sum(f.kind == k for f in self.flips) for k in CLASSES},
                "choices": {k: sum(c.kind == k for c in self.choices) for k in CLASSES}}
