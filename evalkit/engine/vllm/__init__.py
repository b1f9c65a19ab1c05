"""vLLM in this process: its start (start.start_vllm, the door), the engine (engine.VLLMEngine: tokenizer side,
generation and which scoring path takes a request; launch starts its vllm.LLM and records what vLLM resolved),
and its progress bar (bar).

One module per scoring path, each with its planning beside its reading: next_token (one-token
continuations), chained (2 to 16 tokens, read by path), prompt_logprobs (prompt rows, with or without the
prefix cache); path_reads sends the path reads both of the latter plan, cut against vLLM's prefix cache;
second_read is what a read that fails its check twice raises; trace_from_cache the per-token traces (their rows
read and checked by trace_rows, the reads that cover requests of several tokens planned by covering_reads).
"""
