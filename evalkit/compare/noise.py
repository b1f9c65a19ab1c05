"""``python -m evalkit.compare.noise [key=value ...]``: the engine's own run-to-run variation, as a comparison.

Runs one config twice on one engine, the second time submitting the requests in a shuffled order
(``order_seed``), so every batch holds other neighbours; then compares the two runs like
``evalkit.compare``. Any difference is noise that the engine alone causes (batch-dependent kernels,
reductions in another order); read a reference/candidate difference against it with
``python -m evalkit.compare REF CAND --noise <first run> <second run>``. Exits as that comparison does: 0, 1
where the engine alone moved a row beyond the tolerance, 2 on unusable input (a bad key, or runs it cannot compare).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from evalkit.harness.budget import PromptTooLong
from evalkit.config import ConfigError, EvalConfig, compose_config
from evalkit.overrides import check_overrides, prepared
from evalkit.store.fingerprint import answers_key
from evalkit.store.lock import result_lock


def measure(cfg: EvalConfig, engine_factory) -> tuple[Path, Path]:
    """Run cfg twice on the engine engine_factory gives, the second time in a shuffled order. With a divergence
    record, the second run reads the first's top ids its own top-k left out (divergence_reference), as a
    candidate run given the reference does: the noise pair's bound is then as tight as the candidate's, so
    the verdict compares like with like (docs/divergence.md, "Reading the reference's ids")."""
    from evalkit.run.evaluate import evaluate

    cfg = dataclasses.replace(cfg, resume=False)  # the second run must compute, not reuse the first's answers
    first = evaluate(cfg, engine_factory=engine_factory)
    against = str(first) if cfg.divergence_top_k else None
    second = evaluate(dataclasses.replace(cfg, order_seed=cfg.seed + 1, divergence_reference=against),
                      engine_factory=engine_factory)
    return first, second


def main(argv: list[str] | None = None, prog: str = "python -m evalkit.compare.noise") -> int:
    from evalkit.compare import cli
    from evalkit.engine.factory import start_engines
    from evalkit.engine.wrapper import KeptRunning

    overrides = prepared(list(sys.argv[1:] if argv is None else argv))
    if {"-h", "--help"} & set(overrides):
        print(f"usage: {prog} [key=value ...]\n\n{__doc__.split(chr(10), 1)[1].strip()}")
        return 0
    engines = []

    def shared(cfg, model_dir):
        if not engines:
            engines.append(start_engines(cfg, model_dir))  # the only engine of this process (or its Ray actors)
        return KeptRunning(engines[0])

    try:
        options = [a for a in overrides if a.startswith("-")]
        if options:
            raise ConfigError(f"{options[0]}: {prog} takes key=value overrides only, as python -m evalkit does")
        check_overrides(overrides)
        cfg = compose_config(overrides)
        with result_lock(cfg.output_dir, cfg.model_name, answers_key(cfg)):
            first, second = measure(cfg, shared)
    except (ConfigError, PromptTooLong) as error:
        print(f"{prog.removeprefix('python -m ')}: error: {error}", file=sys.stderr)
        return 2
    finally:
        for engine in engines:
            engine.close()
    code = cli.main([str(first), str(second)])  # 1: the engine alone moved a row beyond the tolerance; 2: unusable
    print(f"\nnoise pair: {first} {second}\n(pass to evalkit.compare as --noise {first} {second})")
    return code


if __name__ == "__main__":
    if sys.stderr.isatty():  # said to a person; a script reading stderr sees what it always saw
        print("evalkit: note: `python -m evalkit.compare.noise` is `evalkit noise` (the same arguments)",
              file=sys.stderr)
    raise SystemExit(main())
