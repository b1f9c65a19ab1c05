"""The engine of a run's try, chosen by its config: one vLLM engine, the data-parallel pool, or HF transformers."""

from __future__ import annotations

import sys

from evalkit.config import EvalConfig
from evalkit.contracts import Engine
from evalkit.engine.vllm.start import start_vllm
from evalkit.untrusted import unencrypted_elsewhere, without_credentials


def start_engines(cfg: EvalConfig, model_dir: str) -> Engine:
    """The engine of a run's try: one vLLM engine in this process, the only one it holds, or
    data_parallel_size of them in Ray actors (evalkit/engine/pool/engine.py); with engine=hf, the HF
    transformers reference engine (evalkit/engine/hf/engine.py); with engine=served, a running server
    (evalkit/engine/served/engine.py), or one evalkit starts (endpoint.serve=true)."""
    if cfg.engine == "served":
        return start_served(cfg, model_dir)
    if cfg.engine == "hf":
        from evalkit.engine.hf.engine import HFEngine, check_settings

        check_settings(engine_kwargs=dict(cfg.engine_kwargs), sampling_kwargs=dict(cfg.sampling_kwargs),
                       tensor_parallel_size=cfg.tensor_parallel_size, pipeline_parallel_size=cfg.pipeline_parallel_size)
        engine = HFEngine(model=model_dir, tokenizer=cfg.tokenizer, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                          batch_size=cfg.batch_size, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code,
                          add_bos_token=cfg.add_bos_token, engine_kwargs=dict(cfg.engine_kwargs))
        args, versions = engine.args, engine.describe()["versions"]
        print(f"evalkit: engine=hf (transformers {versions['transformers']}): dtype={args['dtype']}, "
              f"device_map={args['device_map']}, batch_size={args['max_num_seqs']}", file=sys.stderr, flush=True)
        return engine
    if cfg.data_parallel_size > 1:
        from evalkit.engine.pool.engine import DataParallelEngine

        return DataParallelEngine(cfg, model_dir)
    return start_vllm(cfg, model_dir, sole_engine=True)


def start_served(cfg: EvalConfig, model_dir: str) -> Engine:
    """The served engine of cfg: prompts built with the local tokenizer (tokenizer, else the weights folder),
    sent to endpoint.url, or to a server started here from the same keys as offline (endpoint.serve=true)."""
    import os

    from evalkit.engine.served.engine import ServedEngine
    from evalkit.engine.served.http import Client
    from evalkit.engine.served.probe import ServerRefused, deployment, weights_identity

    end = cfg.endpoint
    api_key = os.environ.get(end.api_key_env) if end.api_key_env else None
    host = unencrypted_elsewhere(end.url or "") if api_key else ""
    if host:
        print(f"evalkit: warning: the API key of endpoint.api_key_env={end.api_key_env} goes to {host} over plain "
              "http://, unencrypted on the network: use https:// there", file=sys.stderr, flush=True)
    try:
        identity = weights_identity(started_from=model_dir if end.serve else None, deployment_id=end.deployment,
                                    keeps_answers=cfg.resume, url=without_credentials(end.url or ""))
    except ServerRefused:  # the real problem first: a server that is not there, or serves another model
        deployment(Client(end.url, api_key=api_key, max_concurrency=1, timeout=end.timeout, retries=0,
                          reconnect_wait=0.0), end.model, cfg.max_model_len)
        raise
    server = None
    if end.serve:
        from evalkit.engine.served.start import start_server

        server = start_server(cfg, model_dir)
    url, api_key = (server.url, server.api_key) if server else (end.url, api_key)
    client = Client(url, api_key=api_key, max_concurrency=end.max_concurrency, timeout=end.timeout,
                    retries=end.retries, reconnect_wait=end.reconnect_wait)
    try:
        engine = ServedEngine(client=client, model=end.model, tokenizer=cfg.tokenizer or model_dir,
                              trust_remote_code=cfg.trust_remote_code, add_bos_token=cfg.add_bos_token,
                              max_model_len=cfg.max_model_len, server=server, identity=identity)
    except BaseException:
        if server:
            server.stop()
        raise
    version = engine.deployment["version"]
    print(f"evalkit: engine=served: {engine.url()} serving {engine.model} ("
          f"{f'vLLM {version}' if version else 'no /version'}, max_model_len {engine.deployment['max_model_len'] or 'not reported'}); "
          f"probe {engine.probed}", file=sys.stderr, flush=True)
    return engine
