"""evalkit: accuracy evaluation of LLM inference served by vLLM, scored by lm-eval (README.md, docs/architecture.md)."""
