"""engine=served: a batch of /v1/completions requests sent, and each answer checked before it is kept.

Both ways of reading a server (vLLM's fields, ``served/body.py``; the OpenAI API alone, ``served/openai.py``)
send through :class:`Sender`: every request's body, its read, and the checks every answer passes first (the
probed deployment's ``system_fingerprint``). A request whose answer fails its read is sent once more; a request
that still fails is never scored: the batch's finished answers are handed back with one :class:`ServedError`
naming how many failed and why the first did (the request store keeps the finished ones, so a rerun sends only
the rest).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Callable, Sequence

from evalkit.contracts import PartialAnswers, Progress
from evalkit.engine.logprob_reads import BadRead
from evalkit.engine.served.http import Client, Failure
from evalkit.untrusted import without_credentials

Make = Callable[[Any], dict]  # a request's body; called again for a second try (a fresh cache_salt)
Read = Callable[[Any, dict], Any]  # a request's answer from its response, or BadRead
Tokens = Callable[[Any], int]  # a request's tokens, for the progress bar


class ServedError(PartialAnswers):
    """Some requests of a batch got no verified answer from the server; none of them was scored."""

    def __init__(self, message: str, answers: list[Any], reason: str | None = None) -> None:
        super().__init__(message, answers)
        self.reason = reason or message


def failed(answers: list[Any], reason: str) -> ServedError:
    """The error of a batch whose None answers failed, the first of them for reason."""
    missing = sum(1 for a in answers if a is None)
    return ServedError(f"{missing} of {len(answers)} requests failed: {reason}", answers, reason)


MAX_LOGPROB_TOKEN_IDS = 128  # vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS in 0.32: ids one request may ask for
# The fields members of one request may differ in: each its own prompt; the bundle's cache_salt is its first
# member's (fresh per bundle where each body has its own); its logprob_token_ids the members' together, which vLLM
# 0.32 asks of every prompt of the request (serving.py turns the one request into each prompt's SamplingParams).
APART = ("prompt", "cache_salt", "logprob_token_ids")


def bundles(bodies: Sequence[dict], size: int) -> list[list[int]]:
    """Which bodies go in one request: those equal but for the fields in APART, at most size together and at
    most MAX_LOGPROB_TOKEN_IDS asked ids among them, in the order given."""
    groups: dict[str, list[int]] = {}
    for i, body in enumerate(bodies):
        rest = {k: v for k, v in body.items() if k not in APART}
        groups.setdefault(json.dumps(rest, sort_keys=True), []).append(i)
    found: list[list[int]] = []
    for group in groups.values():
        asked: set[int] = set()
        start = len(found)
        for i in group:
            own = set(bodies[i].get("logprob_token_ids") or ())
            if len(found) > start and len(found[-1]) < size and len(asked | own) <= MAX_LOGPROB_TOKEN_IDS:
                found[-1].append(i)
                asked |= own
            else:
                found.append([i])
                asked = own
    return found


def joined(bodies: Sequence[dict], members: list[int]) -> dict:
    """One request of the members' prompts: vLLM's completions take a list of token-id lists as prompt, and
    every member's logprob_token_ids together (each member reads its own, the rest are ignored)."""
    first = bodies[members[0]]
    if len(members) == 1:
        return first
    together = {**first, "prompt": [bodies[i]["prompt"] for i in members]}
    if any("logprob_token_ids" in bodies[i] for i in members):
        together["logprob_token_ids"] = sorted({t for i in members for t in bodies[i].get("logprob_token_ids") or ()})
    return together


def split(response: Any, members: list[int]) -> list[Any]:
    """Each member's own response (the bundle's with that member's choice alone), a Failure for all, or a
    BadRead for each where the choices do not answer the prompts one each, numbered as sent (``index``)."""
    if len(members) == 1 or isinstance(response, Failure) or not isinstance(response, dict):
        return [response] * len(members)
    choices = response.get("choices")
    choices = [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
    numbered = {c.get("index"): c for c in choices}
    if len(choices) != len(members) or set(numbered) != set(range(len(members))):
        bad = BadRead(f"{len(choices)} choices numbered {list(numbered)[:5]} answer a request of {len(members)} "
                      "prompts, one each numbered 0.. was asked for")
        return [bad] * len(members)
    return [{**response, "choices": [numbered[n]]} for n in range(len(members))]


class Sender:
    """Sends batches to one probed server and keeps only the answers that are its deployment's and read right.
    A first read that fails its check is counted in counts["mismatched"]. With bundle > 1, requests whose
    bodies differ only in their prompt (and their asked logprob_token_ids, see APART) go together, up to bundle
    prompts a request (fewer requests for the server to take in: lm-eval's batch_size); each prompt's answer is
    still read and checked alone, and one that fails its check is sent again alone."""

    def __init__(self, client: Client, *, fingerprint: str | None, counts: Counter[str], bundle: int = 1) -> None:
        self.client = client
        self.fingerprint = fingerprint  # the probe's system_fingerprint: the deployment every answer must come from
        self.counts = counts
        self.most = bundle

    @property
    def bundle(self) -> int:
        """Prompts a request may carry: never more than may be in flight, the client's cap as it is now."""
        return max(1, min(self.most, self.client.max_concurrency))

    def built(self, requests: Sequence[Any], make: Make, read: Read, progress: Progress | None,
              tokens: Tokens) -> list[Any]:
        """As send, with every body built before any is sent: a request that cannot be put into a body (a
        setting the API has no field for) fails the batch before the server sees any of it."""
        try:
            bodies = {id(r): make(r) for r in requests}
        except BadRead as error:
            raise failed([None] * len(requests), str(error)) from None
        return self.send(requests, lambda r: bodies[id(r)], read, progress, tokens)

    def send(self, requests: Sequence[Any], make: Make, read: Read, progress: Progress | None,
             tokens: Tokens) -> list[Any]:
        """Each request sent, its answer read and checked; one that fails its check is sent once more, alone (make
        builds its body again); those still failing raise ServedError after the batch, with the finished
        answers."""
        answers: list[Any] = [None] * len(requests)
        reasons: dict[int, str] = {}
        todo = list(range(len(requests)))
        for round_ in (1, 2):
            again = []
            bundle = self.bundle if round_ == 1 else 1  # a second try goes alone: no other member's ids or fault
            for i, response in zip(todo, self._post([make(requests[i]) for i in todo], bundle)):
                try:
                    if isinstance(response, BadRead):
                        raise response
                    if isinstance(response, Failure):
                        reasons[i] = response.reason
                        continue
                    changed = self._other_deployment(response)
                    if changed:
                        reasons[i] = changed
                        continue
                    answers[i] = read(requests[i], response)
                    reasons.pop(i, None)
                    if progress:
                        progress.advance(1, tokens(requests[i]))
                except BadRead as error:
                    reasons[i] = f"the answer failed its check twice ({error})"
                    again.append(i)
            self.counts["mismatched"] += len(again) if round_ == 1 else 0
            todo = again
            if not todo:
                break
        if reasons:
            raise failed(answers, reasons[min(reasons)])
        return answers

    def _post(self, bodies: list[dict], bundle: int) -> list[Any]:
        """Each body's response (or Failure, or BadRead), the bodies sent in bundles of at most bundle."""
        groups = bundles(bodies, bundle)
        self.counts.update(http_requests=len(groups))
        responses = self.client.post_many("/completions", [joined(bodies, members) for members in groups])
        found: list[Any] = [None] * len(bodies)
        for members, response in zip(groups, responses):
            for i, own in zip(members, split(response, members)):
                found[i] = own
        return found

    def _other_deployment(self, response: Any) -> str | None:
        """Why an answer is not the probed deployment's: its system_fingerprint differs from the probe's (a server
        restarted under other settings or version, a replica of another build behind a load balancer). Such an
        answer is never read or kept, so no run mixes two deployments' answers."""
        seen = response.get("system_fingerprint") if isinstance(response, dict) else None
        if seen == self.fingerprint:
            return None
        return (f"the server's system_fingerprint changed from {self.fingerprint} (at the probe) to "
                f"{seen}: another deployment answers at {without_credentials(self.client.url)}; its answers were "
                "not kept, run again to evaluate it as itself")
