"""The lm-eval internals evalkit relies on (evalkit/harness/lm_eval_compat.py): fails the day one moves or
changes. Run: pytest tests/test_lm_eval_compat.py"""

import json
from importlib.metadata import version
from pathlib import Path

from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from packaging.specifiers import SpecifierSet

from evalkit.harness import lm_eval_compat
from evalkit.harness.lm import EvalkitLM
from evalkit.harness.task_index import task_manager_for
from tests.fake_engine import BOS, FakeEngine

ARITH = Path(__file__).resolve().parent.parent / "tasks" / "evalkit_arith"
DATA = {"dataset_kwargs": {"data_files": {"test": str(ARITH / "test.jsonl")}}}  # absolute: no evalkit rewriting


def test_the_installed_lm_eval_is_in_the_checked_range_which_pyproject_allows():
    assert version("lm_eval") in SpecifierSet(lm_eval_compat.CHECKED)
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert f'"lm-eval{lm_eval_compat.CHECKED}"' in pyproject


def test_the_task_loader_internals_are_where_they_were():
    manager = task_manager_for(["evalkit_arith"])
    entry = manager.task_index["evalkit_arith"]
    config = lm_eval_compat.full_config(manager, entry)
    assert config["task"] == "evalkit_arith"
    task = lm_eval_compat.build_task(manager, entry, {"num_fewshot": 0, **DATA})
    assert task.config.task == "evalkit_arith" and task.config.num_fewshot == 0


def test_pairs_are_encoded_as_template_lm_encodes_them():
    """encode_pairs against TemplateLM.loglikelihood itself, an empty context (both cases) included."""
    lm = EvalkitLM(FakeEngine(adds_bos=True), model_name="m", max_tokens=8)
    pairs = [("Question: 2+2?", " 4"), ("", "text"), ("", chr(BOS) + "text"), ("a b ", "c")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=0) for p in pairs]
    seen = []
    lm._loglikelihood_tokens = lambda encoded, **kwargs: seen.extend(encoded) or [(0.0, True)] * len(encoded)
    TemplateLM.loglikelihood(lm, requests)
    assert lm_eval_compat.encode_pairs(lm, requests) == seen


def test_environment_facts_gathered_ahead_are_lm_evals_own():
    """simple_evaluate still adds its environment facts through lm_eval.evaluator.add_env_info (the name
    env_info_ahead replaces); within env_info_ahead that name gives lm-eval's own dict, gathered once per process
    and working directory, and outside it lm-eval's function runs as before."""
    import inspect

    import lm_eval.evaluator
    from lm_eval.loggers.utils import add_env_info

    assert "add_env_info(results)" in inspect.getsource(lm_eval.evaluator.simple_evaluate)
    theirs: dict = {}
    add_env_info(theirs)
    with lm_eval_compat.env_info_ahead():
        ahead: dict = {"kept": 1}
        lm_eval.evaluator.add_env_info(ahead)
    after: dict = {}
    lm_eval.evaluator.add_env_info(after)
    assert set(theirs) == {"pretty_env_info", "transformers_version", "lm_eval_version", "upper_git_hash"}
    assert ahead == {"kept": 1, **theirs} and after == theirs
    assert lm_eval_compat.gather_env_info() is lm_eval_compat.gather_env_info()


def test_the_environment_text_is_torchs_own():
    """pretty_env_info gathers torch's collect_env fields itself (all but one through collect_env's functions):
    on this machine, where torch's own get_pretty_env_info touches no GPU, the text is the same. Fails the day
    torch adds, drops or renames a field of SystemEnv."""
    from torch.utils.collect_env import get_pretty_env_info

    assert lm_eval_compat.pretty_env_info() == get_pretty_env_info()


def test_the_environment_facts_start_no_cuda_on_a_gpu_machine(tmp_path):
    """On a GPU machine recreated here (tests/gpu_machine: two H100s at NVML, torch's CUDA runtime calls recorded
    and failing), the facts a try gathers make no CUDA runtime call: torch's collect_env calls torch.cuda.init()
    to read CUDA_MODULE_LOADING, a CUDA context on GPU 0 beside the engine. The fields are lm-eval's."""
    from tests.test_gpu_start import check_in_gpu_machine

    code = ("import json, os\nos.environ['CUDA_MODULE_LOADING'] = 'EAGER'\n"
            "from evalkit.harness import lm_eval_compat\nfacts = {}\nlm_eval_compat.gather_env_info().into(facts)\n"
            "print(json.dumps(facts))")
    out, calls = check_in_gpu_machine(tmp_path, code, nvml_check=True)
    assert calls == []
    facts = json.loads(out.splitlines()[-1])
    assert set(facts) == {"pretty_env_info", "transformers_version", "lm_eval_version", "upper_git_hash"}
    assert "Is CUDA available: True" in facts["pretty_env_info"]
    assert "CUDA_MODULE_LOADING set to: EAGER" in facts["pretty_env_info"]
