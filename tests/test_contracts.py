"""Every engine and every wrapper implements the Engine contract (evalkit/contracts.py) in full, ``trace``
included, and none forwards through ``__getattr__`` (STYLE rule 11). Run: pytest tests/test_contracts.py

Engines that need vLLM, torch or Ray to start are checked without starting them: an instance made without
``__init__`` (given its ``max_model_len``) must pass ``isinstance(engine, Engine)``, and its methods take the
contract's arguments."""

import inspect

import pytest

from evalkit.contracts import Engine, ScoreRequest
from evalkit.engine.pool.engine import DataParallelEngine
from evalkit.engine.hf.engine import HFEngine
from evalkit.store.requests import RequestStore, ResumableEngine
from evalkit.engine.served.engine import ServedEngine
from evalkit.engine.vllm.engine import VLLMEngine
from evalkit.engine.wrapper import Deferred, KeptRunning, Wrapped
from benchmarks.common.evalkit_side import RecordingEngine
from tests.fake_engine import FakeEngine

METHODS = [name for name, value in vars(Engine).items() if callable(value) and not name.startswith("_")]
MEMBERS = [*Engine.__annotations__, *METHODS]  # the attributes (max_model_len) and the methods
WRAPPERS = [Wrapped, KeptRunning, ResumableEngine, RecordingEngine]
CLASSES = [VLLMEngine, HFEngine, ServedEngine, DataParallelEngine, FakeEngine, Deferred, *WRAPPERS]


def test_the_contract_names_trace_and_the_scoring_counts():
    assert {"trace", "score", "generate", "scoring_counts", "chat_template", "describe", "close"} <= set(METHODS)
    assert {"max_model_len", "logits_dtype"} <= set(MEMBERS)


def test_the_wrappers_base_writes_out_every_member_of_the_contract():
    """Wrapped defines each member itself (not inherited, not forwarded), so a member added to the contract
    fails here until the base passes it through, rather than going missing from every wrapper."""
    assert [name for name in MEMBERS if name not in vars(Wrapped)] == []
    assert all(issubclass(cls, Wrapped) for cls in WRAPPERS)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_engine_class_implements_every_method_with_the_contracts_arguments(cls):
    assert "__getattr__" not in vars(cls)
    if isinstance(getattr(cls, "max_model_len", None), property):  # a wrapper's: its engine's (checked below)
        assert all(callable(getattr(cls, name, None)) for name in METHODS)
    else:
        bare = object.__new__(cls)
        bare.max_model_len, bare.logits_dtype = 1, "float32"
        assert isinstance(bare, Engine)
    for name in METHODS:
        wanted = [p for p in inspect.signature(getattr(Engine, name)).parameters.values()]
        have = inspect.signature(getattr(cls, name)).parameters
        for p in wanted:
            assert p.name in have, f"{cls.__name__}.{name} lacks {p.name}"
            assert (p.default is inspect.Parameter.empty) or have[p.name].default == p.default, (cls, name, p.name)


def test_wrappers_pass_every_call_through(tmp_path):
    """An engine kept running (KeptRunning), the resumable one and the benchmark's recorder answer as the engine
    they wrap: trace and counts included."""
    engine = FakeEngine()
    resumable = ResumableEngine(engine, RequestStore(tmp_path / "store.jsonl"), chunk_size=4)
    request = [ScoreRequest(ids=(1, 97, 98), start=1)]
    for wrapper in (Wrapped(engine), KeptRunning(engine), resumable, KeptRunning(resumable), RecordingEngine(engine)):
        assert isinstance(wrapper, Engine)
        assert wrapper.trace(request) == engine.trace(request)
        assert wrapper.max_model_len == engine.max_model_len and wrapper.scoring_counts() == {}
        assert wrapper.encode("ab", True) == engine.encode("ab", True) and wrapper.chat_template() is None
    KeptRunning(engine).close()
    assert not engine.closed  # the lender closes it
    resumable.close()
    assert engine.closed


def test_the_recorder_writes_down_what_it_passes_through():
    engine = FakeEngine()
    recorder = RecordingEngine(engine)
    request = [ScoreRequest(ids=(1, 97, 98), start=1)]
    assert recorder.score(request, fast=False) == engine.score(request, fast=False)
    requests, answers, _, calls = recorder.take("score")
    assert (requests, answers, calls) == (request, engine.score(request), 1) and recorder.take("score")[3] == 0
    recorder.close()
    assert engine.closed
