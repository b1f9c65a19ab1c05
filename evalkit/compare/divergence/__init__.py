"""How far did the candidate's output distribution move from the reference's? Token-level divergence between
two runs on the tasks' own text, measured as llama.cpp's ``llama-perplexity --kl-divergence`` does.

The flow, one module per step, all pure functions:

* sides: what one run knows at each scored position (a ``Side``: top entries, ids it was asked for, or the
  full distribution, with the text token), checked as it is built;
* bound: KL(P_ref || P_cand) exact from two full distributions, else a sound lower bound by coarsening to the
  tokens known on both sides plus a rest bucket, with the reference mass it captured;
* positions: every measure per position (KLD, top-1 agreement with its tie rule, Δp, log-likelihood ratio);
* stats: the figures over documents (Mean KLD, percentiles, Same top p, Mean and RMS Δp, PPL ratio) with
  intervals that treat the document as the unit, per task and overall;
* verdict: "beyond noise" / "within noise" / "unusable" against a second reference run, exit codes 1 / 0 / 2.

Over two runs' folders (``python -m evalkit.compare``): records reads each run's record
(evalkit/run/divergence_record.py) and pairs the positions whose contexts are the same; between measures and
summarises them per task and runs the verdict against a noise pair; report and report_page show them in compare's
text report and page.

User documentation: docs/divergence.md.
"""

from evalkit.compare.divergence.bound import MASS_TOL, coarse_kl, exact_kl
from evalkit.compare.divergence.positions import TIE_TOL, Positions, measure
from evalkit.compare.divergence.sides import PAD, Side, from_rows, full_distribution, top_entries
from evalkit.compare.divergence.stats import (Estimate, Summary, document_divergence, summarize,
                                              summarize_tasks)
from evalkit.compare.divergence.verdict import ALPHA, EXIT, NoiseVerdict, family, min_documents, noise_verdict

__all__ = ["ALPHA", "EXIT", "MASS_TOL", "PAD", "TIE_TOL", "Estimate", "NoiseVerdict", "Positions", "Side",
           "Summary", "coarse_kl", "document_divergence", "exact_kl", "family", "from_rows", "full_distribution",
           "measure", "min_documents", "noise_verdict", "summarize", "summarize_tasks", "top_entries"]
