"""How much of the true KL does the top-k lower bound capture, and what does k cost? On the embedded model.

SmolLM2-135M (the converted safetensors in ~/.cache/evalkit/smollm2-135m-instruct) through transformers and torch
on the CPU, on the repo's own tasks: each evalkit_facts document is its prompt followed by each choice, each
evalkit_arith document its prompt followed by the answer, as lm-eval scores them ("Question: ...\\nAnswer: x").
Every position of each text is scored once (the prompt's positions from the first sequence, then every
continuation token); documents are the clusters.

Runs, each giving float32 log-probabilities over the whole vocabulary at every position (a bfloat16 model's
logits are cast to float32 before log_softmax, as engines do):
  ref: float32, one sequence at a time;
  bf16: the same weights in bfloat16;
  perturbed: float32 with one layer's MLP output weights moved by a seeded N(0, (SCALE * their std)^2);
  noise: float32 again, the document's sequences batched together (padding changes the kernels' shapes),
  a second reference run whose divergence from ref is the engine's own noise.

For each candidate against ref: the exact KL per position; the lower bound at k = 5, 10, 20, 50, 100 with
(asked) the reference's top-k plus the candidate's log-probabilities at those ids (as a candidate asked with
logprob_token_ids) and its own top-k, and (own) each side's own top-k only. It checks that no position's bound
is above the exact value beyond float error, prints the captured share (mean bound / mean exact) per k over all
positions and over continuation tokens alone, the bytes per position of a float32 log-probability + int32 id
layout, and the verdict against noise with the exact KL and with the bound at each k (with how well each k keeps
the documents' order by divergence: the rank correlation of per-document bound and exact KLD).
Run: .venv/bin/python -m benchmarks.divergence_bound [--documents 20] [--scale 0.2] [--layer 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT
from evalkit.compare.divergence import document_divergence, measure, noise_verdict, summarize, top_entries
from evalkit.compare.divergence.sides import PAD

MODEL = Path(os.path.expanduser("~/.cache/evalkit/smollm2-135m-instruct"))
KS = (5, 10, 20, 50, 100)
TOP = max(KS)
EXCESS = 1e-6  # nats: a bound above the exact value by more than this would not be float error


def documents(limit: int) -> list[tuple[str, str, list[str]]]:
    """(key, prompt, continuations) for the first limit documents of evalkit_facts and of evalkit_arith."""
    out = []
    for task in ("evalkit_facts", "evalkit_arith"):
        for line in (ROOT / "tasks" / task / "test.jsonl").read_text().splitlines()[:limit]:
            row = json.loads(line)
            choices = row["choices"] if "choices" in row else [row["answer"]]
            out.append((f"{task}/{row['id']}", f"Question: {row['question']}\nAnswer:", [f" {c}" for c in choices]))
    return out


def tokenize(tokenizer, prompt: str, continuations: list[str]) -> tuple[list[list[int]], int]:
    """Each full sequence's ids, and the prompt's length in tokens (the same prefix in each, checked)."""
    context = tokenizer(prompt).input_ids
    sequences = [tokenizer(prompt + c).input_ids for c in continuations]
    for s in sequences:
        if s[:len(context)] != context:
            raise SystemExit(f"{prompt!r}: a continuation changes the prompt's tokens")
    return sequences, len(context)


def log_probs(model, sequences: list[list[int]], *, batched: bool):
    """Float32 log-probabilities (L - 1, V) predicting tokens 1..L-1 of each sequence."""
    import torch

    with torch.no_grad():
        if not batched:
            return [torch.log_softmax(model(torch.tensor([s])).logits[0, :-1].float(), -1).numpy() for s in sequences]
        width = max(len(s) for s in sequences)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
        out = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1).numpy()
        return [out[i, :len(s) - 1] for i, s in enumerate(sequences)]


def scored(sequences: list[list[int]], context: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(sequence, rows, continuation?) to score: every row of the first sequence, then the others'
    continuation rows (row t predicts token t + 1; the prompt's rows are the same in every sequence)."""
    first = np.arange(len(sequences[0]) - 1)
    out = [(0, first, first >= context - 1)]
    for i, s in enumerate(sequences[1:], start=1):
        rows = np.arange(context - 1, len(s) - 1)
        out.append((i, rows, np.ones(len(rows), dtype=bool)))
    return out


def top(lp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.argpartition(-lp, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(lp, ids, axis=1), axis=1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=1)
    return ids, np.take_along_axis(lp, ids, axis=1)


def pair_rows(ref: np.ndarray, cand: np.ndarray, text: np.ndarray) -> dict[str, np.ndarray]:
    """What the comparison of one sequence's rows needs: the exact measures and both sides' top entries."""
    from evalkit.compare.divergence import full_distribution

    exact = measure(full_distribution(text, ref), full_distribution(text, cand))
    r_ids, r_lp = top(ref, TOP)
    c_ids, c_lp = top(cand, TOP)
    rows = np.arange(len(text))
    return dict(exact=exact.kld, exact_top=exact.same_top, r_ids=r_ids, r_lp=r_lp, c_ids=c_ids, c_lp=c_lp,
                c_at_r=np.take_along_axis(cand, r_ids, axis=1), text=text, text_r=ref[rows, text],
                text_c=cand[rows, text])


def bounds(data: dict[str, np.ndarray], k: int):
    """The measures at k: (own) each side's own top-k; (asked) the candidate also read at the reference's ids."""
    ref = top_entries(data["text"], data["text_r"], data["r_ids"][:, :k], data["r_lp"][:, :k])
    own_c = top_entries(data["text"], data["text_c"], data["c_ids"][:, :k], data["c_lp"][:, :k])
    r_ids, c_ids = data["r_ids"][:, :k], data["c_ids"][:, :k]
    repeated = (c_ids[:, :, None] == r_ids[:, None, :]).any(axis=2)
    asked_c = top_entries(data["text"], data["text_c"],
                          np.concatenate([r_ids, np.where(repeated, PAD, c_ids)], axis=1),
                          np.concatenate([data["c_at_r"][:, :k], np.where(repeated, np.nan, data["c_lp"][:, :k])],
                                         axis=1))
    return measure(ref, own_c), measure(ref, asked_c)


def load(dtype_name: str, *, scale: float = 0.0, layer: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=getattr(torch, dtype_name)).eval()
    if scale:
        weight = model.model.layers[layer].mlp.down_proj.weight
        noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            weight += scale * weight.std() * noise
    return model


def collect(limit: int, scale: float, layer: int, threads: int
            ) -> tuple[dict[str, dict[str, np.ndarray]], np.ndarray, list[str]]:
    """Every pair's rows over all documents, whether each position is a continuation token, its document."""
    import torch
    from transformers import AutoTokenizer

    # On a shared 2-core machine torch's spinning OpenMP workers lose to the other load: measured 1.9 s per
    # 24-token float32 forward with two threads under load, 0.2 s with one.
    torch.set_num_threads(threads)

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    models = {"ref": load("float32"), "bf16": load("bfloat16"), "perturbed": load("float32", scale=scale, layer=layer)}
    parts: dict[str, list] = {"bf16": [], "perturbed": [], "noise": []}
    continuation, keys = [], []
    for key, prompt, continuations in documents(limit):
        sequences, context = tokenize(tokenizer, prompt, continuations)
        runs = {name: log_probs(m, sequences, batched=False) for name, m in models.items()}
        runs["noise"] = log_probs(models["ref"], sequences, batched=True)
        for i, rows, cont in scored(sequences, context):
            text = np.asarray(sequences[i][1:])[rows]
            for name in parts:
                parts[name].append(pair_rows(runs["ref"][i][rows], runs[name][i][rows], text))
            continuation.append(cont)
            keys += [key] * len(rows)
    data = {name: {f: np.concatenate([p[f] for p in chunks]) for f in chunks[0]} for name, chunks in parts.items()}
    return data, np.concatenate(continuation), keys


def bytes_per_position(k: int) -> tuple[int, int]:
    """A run's own record (top-k float32 log-probabilities + int32 ids, the text token's log-probability), and a
    candidate asked for the reference's k ids (their log-probabilities, its own top-1 id and value, the text's)."""
    return 8 * k + 4, 4 * k + 8 + 4


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=20, help="documents of each task")
    parser.add_argument("--scale", type=float, default=0.2, help="perturbation, in units of the weights' std")
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    options = parser.parse_args(argv)
    began = time.perf_counter()
    data, continuation, keys = collect(options.documents, options.scale, options.layer, options.threads)
    print(f"{len(keys)} positions ({int(continuation.sum())} continuation tokens) in {len(set(keys))} documents; "
          f"perturbed: layer {options.layer}'s mlp.down_proj + N(0, ({options.scale} std)^2); collected in "
          f"{time.perf_counter() - began:.0f} s\n")
    report_bounds(data, continuation)
    report_verdicts(data, keys)
    print(f"\n{time.perf_counter() - began:.0f} s")


def report_bounds(data: dict[str, dict[str, np.ndarray]], continuation: np.ndarray) -> None:
    print("| pair | k | share (asked) | share (own) | continuation share (asked / own) | max bound - exact | "
          "same top p, bound / exact | bytes/position (record / asked) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("bf16", "perturbed", "noise"):
        d = data[name]
        exact, cont = d["exact"], continuation
        for k in KS:
            own, asked = bounds(d, k)
            excess = max(float((own.kld - exact).max()), float((asked.kld - exact).max()))
            flag = "" if excess <= EXCESS else " ABOVE THE EXACT VALUE"
            record, asked_bytes = bytes_per_position(k)
            print(f"| {name} (mean KLD {exact.mean():.2e}) | {k} | {asked.kld.mean() / exact.mean():.3f} | "
                  f"{own.kld.mean() / exact.mean():.3f} | {asked.kld[cont].mean() / exact[cont].mean():.3f} / "
                  f"{own.kld[cont].mean() / exact[cont].mean():.3f} | {excess:.1e}{flag} | "
                  f"{np.nanmean(asked.same_top):.4f} / {np.nanmean(d['exact_top']):.4f} | "
                  f"{record} / {asked_bytes} |")
    print("\nllama.cpp's full-vocabulary file: 2 V + 8 bytes per position (98,312 here; 256,520 for Llama-3)")


def report_verdicts(data: dict[str, dict[str, np.ndarray]], keys: list[str]) -> None:
    from scipy.stats import spearmanr

    print("\n| candidate | KLD from | Mean KLD [95 %] | Same top p [95 %] | RMS Δp | PPL(Q)/PPL(base) | "
          "noise Mean KLD | verdict (p) | per-document rank corr. with exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    noise = data["noise"]
    for name in ("bf16", "perturbed"):
        d = data[name]
        exact = document_divergence(d["exact"], keys)
        for label, k in [("exact", None)] + [(f"asked k={k}", k) for k in KS]:
            cand = _positions(d, k)
            base = _positions(noise, k)
            s = summarize(cand, keys)
            per_document = document_divergence(cand.kld, keys)
            v = noise_verdict(per_document, document_divergence(base.kld, keys))
            rho = spearmanr(list(per_document.values()), list(exact.values()))[0]
            print(f"| {name} | {label} | {s.mean_kld.value:.2e} [{s.mean_kld.low:.2e}, {s.mean_kld.high:.2e}] | "
                  f"{s.same_top.value:.4f} [{s.same_top.low:.4f}, {s.same_top.high:.4f}] | {s.rms_dp.value:.4f} | "
                  f"{s.ppl_ratio.value:.5f} | {base.kld.mean():.2e} | {v.label} ({v.p_value:.2g}) | {rho:.3f} |")


def _positions(d: dict[str, np.ndarray], k: int | None):
    """The candidate's measures: exact (from the full distributions) or the asked bound at k."""
    if k is not None:
        return bounds(d, k)[1]
    from evalkit.compare.divergence import Positions

    rows = np.arange(len(d["text"]))
    return Positions(kld=d["exact"], exact=np.ones(len(rows), dtype=bool), captured=np.ones(len(rows)),
                     same_top=d["exact_top"], delta_p=np.exp(d["text_c"]) - np.exp(d["text_r"]),
                     llr=d["text_c"] - d["text_r"])


if __name__ == "__main__":
    main(sys.argv[1:])
