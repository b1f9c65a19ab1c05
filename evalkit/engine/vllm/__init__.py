"""vLLM in this process: the engine (engine.VLLMEngine), its start (start.start_vllm, the door) and its
progress bar (bar)."""
