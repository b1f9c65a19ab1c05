"""The engine: what answers evalkit's requests, behind the Engine protocol (evalkit/contracts.py).

Each kind of engine has its own folder, and siblings do not import each other: ``vllm/`` (vLLM in this
process), ``served/`` (an OpenAI-compatible server over HTTP), ``hf/`` (HF transformers, the reference) and
``pool/`` (data-parallel vLLM engines on Ray). ``machine/`` is what they read of the machine: its GPUs, its
environment, the checks before a start, the settings chosen for it, the embedded model and process groups.
The top holds what every kind shares: ``factory`` (the door: start_engines), ``wrapper`` (engines that wrap
an engine), ``backoff`` (the memory back-off), ``logprob_reads`` and ``read_plan`` (reading log-probabilities
the same way on every engine, and what one path read asks for) and ``tokenizer``.
"""
