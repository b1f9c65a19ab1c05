"""The contracts between stages: what an engine must do, and the frozen records that cross stage borders.

The harness (lm-eval adapter) talks to any :class:`Engine`: the real vLLM one in ``engine/vllm/engine.py``, or a
deterministic fake in the unit tests,
and every wrapper around one (the request store, an engine kept running, the data-parallel pool) implements it in full:
``isinstance(x, Engine)`` checks that each method is there (tests/test_contracts.py). Token ids are the currency; text only enters and leaves through
the engine's tokenizer methods.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class GenRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    stop: tuple[str, ...] = ()
    # every other vllm.SamplingParams setting, as (name, value) pairs: the task's own generation settings
    # (temperature, top_p, ...) plus evalkit's overrides, exactly as the engine receives them
    sampling: tuple[tuple[str, Any], ...] = ()

    @property
    def greedy(self) -> bool:
        """Whether the answer is a function of the request alone (no sampling): identical requests may share it.
        A request that names no temperature gets vLLM's default, 1.0: it samples."""
        return float(dict(self.sampling).get("temperature", 1.0)) < 1e-5  # vLLM's _SAMPLING_EPS


@dataclass(frozen=True)
class TokenTrace:
    """Teacher forcing of one ScoreRequest: at each position of ids[start:], the log-probability the engine
    gives that token, and its top-k (token id, log-probability) pairs, best first."""

    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]
    # per position, the (token id, log-probability) of ids read apart because another run's top list named them
    # and this one's did not (``Engine.read_ids``: a reference's top ids, docs/divergence.md); () where none were
    given: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True)
class IdsRead:
    """The log-probabilities of ``ids`` as the next token after ``context`` (vLLM's ``logprob_token_ids``)."""

    context: tuple[int, ...]
    ids: tuple[int, ...]


# A log-probability read in one engine call and the same one read in another (another batch, prefill against
# decode, a cached prefix, another kernel) agree to the last bit only where the engine is bit-stable. A reduced
# dtype rounds the logits z (the model's output, the input of log_softmax), not the log-probability: vLLM and
# evalkit's HF engine take log p_i = z_i - logsumexp(z) in float32 from logits computed in the model's dtype. A
# change dz_j of every logit moves log p_i by dz_i - sum_j p_j dz_j: at most two logits' worth, that of z_i and
# that of the logits holding the mass. A logit of magnitude below 2^e lies on a grid of 2^(e-1-m) (m: the dtype's
# mantissa bits), so at the logit scale LOGIT_SCALE the two calls may put log p_i APART_STEPS grid steps apart
# (two logits, each rounded to either side of its value and moved a step by the layers before it): 1 nat in
# bfloat16, 1/8 in float16, and ENTRY_TOLERANCE in float32, whatever the log-probability's own size. Two calls
# that disagree by more are the engine's noise all the same (docs/divergence.md, "Where numerics are not
# bit-stable"): a check of values from two calls counts such positions and never ends a run; a read of another
# context is caught by the exact checks (ids, lengths, the request), not by a value. An engine whose dtype is
# unknown (a server's) is held to bfloat16's.
ENTRY_TOLERANCE = 1e-4  # nats: one value read twice from one row (the text token, its top entry), or a tie in order
MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}  # the explicit significand bits of each dtype
LOGIT_SCALE = 64.0  # the logits' magnitude the tolerance allows for (below 64: a bfloat16 grid of 1/4)
APART_STEPS = 4


def logit_step(dtype: str, scale: float = LOGIT_SCALE) -> float:
    """The rounding grid of a logit of magnitude below scale, for a model computing its logits in dtype (an
    unknown dtype: bfloat16's)."""
    bits = MANTISSA_BITS.get(dtype, MANTISSA_BITS["bfloat16"])
    return 2.0 ** (math.ceil(math.log2(scale)) - 1 - bits)


def apart_tolerance(dtype: str) -> float:
    """How far (nats) a log-probability read in one engine call may lie from the same one read in another
    within the rounding of an engine computing its logits in dtype (the comment above says why)."""
    return max(ENTRY_TOLERANCE, APART_STEPS * logit_step(dtype))


def apart_words(dtype: str) -> str:
    """The tolerance of :func:`apart_tolerance` and why, for a message."""
    known = dtype if dtype in MANTISSA_BITS else f"{dtype or 'an unknown dtype'}, held to bfloat16's"
    return (f"{apart_tolerance(dtype):.3g} nats between two engine calls ({APART_STEPS} rounding steps of "
            f"{known} logits below {LOGIT_SCALE:g})")


def top_list_fault(token: int, value: float, top: Sequence[tuple[int, float]], tolerance: float, *,
                   unlisted: float | None = None) -> str | None:
    """Why one position's read cannot be a row of log-probabilities: its text token (value) and its top entries
    (token id, log-probability). None where it can: the entries distinct and best first, the token's value that
    of its own entry where listed, and not above the last entry where not listed (it would have been listed).
    tolerance: how far apart one value read twice from one row may be. The engine's reads (trace_rows.py) and
    the harness's check of every trace (divergence_traces.py) share it. unlisted: the tolerance of the last test
    where the token's value may come from another engine call than its top entries (apart_tolerance); tolerance
    if None."""
    ids = [t for t, _ in top]
    if len(set(ids)) != len(ids):
        return f"repeats a token among its top entries {ids}"
    if any(later > earlier + tolerance for (_, earlier), (_, later) in zip(top, top[1:])):
        return "lists its top entries out of order (not best first)"
    own = dict(top).get(token)
    if own is not None and abs(own - value) > tolerance:
        return f"gives the text token {value:.6g} but {own:.6g} among its top entries"
    allowed = tolerance if unlisted is None else unlisted
    if own is None and top and value > top[-1][1] + allowed:
        return (f"gives the text token {value:.6g}, above its last top entry {top[-1][1]:.6g} by more than "
                f"{allowed:.3g} nats, yet leaves it out: a read of another position or token")
    return None


@dataclass(frozen=True)
class Generation:
    text: str
    finish_reason: str  # "stop" (a stop string or end-of-sequence) or "length" (hit max_tokens)
    output_tokens: int
    token_ids: tuple[int, ...] = ()
    # asked with top_k > 0 of a greedy request: at each output token, its log-probability and the top-k at that
    # step, read in the same pass that generated it (one entry per token id); None where the engine gave none
    trace: TokenTrace | None = None


@dataclass(frozen=True)
class ScoreRequest:
    """Score tokens ``ids[start:]`` given everything before them."""

    ids: tuple[int, ...]
    start: int


@dataclass(frozen=True)
class Scored:
    logprob: float  # sum of the log-probabilities of ids[start:]
    is_greedy: bool  # every scored token was the engine's top-1 choice
    # asked with top_k > 0: the trace of the scored positions (ids[max(start, 1):]), read by the reads that scored
    # them where the engine can; None where the engine gave none (an empty continuation has no position)
    trace: TokenTrace | None = None


class PartialAnswers(RuntimeError):
    """An engine call that answered some of its requests and not others (a server that refused a few):
    ``answers`` holds each finished answer in request order, None where it failed, so a wrapper that keeps
    answers (store/requests.py) saves them before the error propagates and a rerun sends only the rest."""

    def __init__(self, message: str, answers: list[Any]) -> None:
        super().__init__(message)
        self.answers = answers


@runtime_checkable
class Progress(Protocol):
    """Where an engine reports finished requests (evalkit/run/progress.py prints them as one line per kind)."""

    def advance(self, requests: int = 1, tokens: int = 0) -> None: ...

    def engine_bar(self) -> Any:
        """A factory vLLM's ``use_tqdm`` accepts, reporting to this progress instead of drawing a bar."""


class RequestProgress(Progress, Protocol):
    """Progress of one request kind over a known number of requests, opened and closed by the harness for each
    engine call (evalkit/run/progress.py's ``Progress(label, total)`` prints it)."""

    def close(self) -> None: ...


@runtime_checkable
class Engine(Protocol):
    max_model_len: int
    # the dtype the engine computes its logits in ("float32", "bfloat16", "float16"; "" where it cannot know, as a
    # server's): how far two of its calls may round the same value apart (apart_tolerance)
    logits_dtype: str

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of text; with add_special_tokens, the tokenizer adds what it adds by default (BOS for Llama)."""

    def decode(self, ids: Sequence[int]) -> str: ...

    def prefix_token_id(self) -> int:
        """The token that stands before an empty context (BOS, or EOS where a model has no BOS)."""

    def eos_token_id(self) -> int: ...

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The chat template applied to messages; without a generation prompt the last message is continued."""

    def chat_template(self) -> str | None:
        """The tokenizer's chat template, for the results file (None where it has none)."""

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None, *,
                 top_k: int = 0) -> list[Generation]:
        """Each request's generation; with top_k > 0, each greedy one's ``trace`` of its output tokens too."""

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True, top_k: int = 0) -> list[Scored]:
        """Log-probabilities of each request's continuation; fast lets the engine take its cheaper paths (the
        same numbers, within its own batch-to-batch noise), or not (``fast_scoring=false``). With top_k > 0,
        each answer's ``trace`` too (the divergence record), from the same reads where the engine can."""

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        """Per-token log-probabilities and top-k of each request's continuation, from the raw logits (no
        sampling): where two engines' outputs diverge (evalkit/compare/locate/passes.py), and what an engine
        answers in ``Scored.trace`` where it cannot read both in one pass."""

    def read_ids(self, reads: Sequence[IdsRead]) -> list[tuple[float, ...]]:
        """Each read's log-probability of every asked id after its context, in the order asked, from the raw
        logits: a candidate's record reads the reference's top ids its own top-k left out (divergence_reference,
        docs/divergence.md), so the bound covers the reference's whole top-k."""

    def scoring_counts(self) -> dict[str, int]:
        """A snapshot of what the engine's scoring paths did so far (vLLM: single_token, cache_hits, ...), for
        the results file: the run records the difference over its own calls. {} where an engine keeps none."""

    def describe(self) -> dict[str, Any]:
        """Engine arguments actually used and library versions, for the results file."""

    def close(self) -> None: ...


@dataclass
class RequestRecord:
    """What evalkit saw of one request, merged into the per-sample output next to lm-eval's fields."""

    kind: str  # generate_until | loglikelihood | loglikelihood_rolling
    prompt_tokens: int
    output_tokens: int = 0
    finish_reason: str | None = None
    raw_output: str | None = None  # before the thinking section was stripped
    output_ids: list[int] | None = None  # generated token ids, to find where two runs diverge
    requested_max_tokens: int | None = None
    max_tokens: int | None = None  # what the engine was given after the length budget
    clamped: bool = False  # max_tokens was lowered to fit max_model_len
    truncated_tokens: int = 0  # prompt tokens dropped from the left under overflow=truncate_left
    extra: dict[str, Any] = field(default_factory=dict)
    # with divergence_top_k > 0, what was traced for the run's divergence record (evalkit/harness/divergence_traces.py),
    # as (request number in its document, the traced request, its trace): one, or one per rolling window. Written
    # to the divergence record, not to the samples
    traced: list[tuple[int, ScoreRequest, TokenTrace]] = field(default_factory=list, repr=False)
