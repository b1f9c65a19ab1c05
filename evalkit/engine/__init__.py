"""Stage 2, the engine: vLLM behind evalkit's Engine contract (vllm_engine), the settings chosen for the machine
(tuning), checks before it starts (preflight), the embedded model (embedded) and crash-safe resume (store)."""
