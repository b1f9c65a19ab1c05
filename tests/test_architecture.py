"""The stage order as a contract (pyproject.toml, [tool.importlinter]): each stage imports only the stages
below it, each kind of engine (evalkit/engine/*/) only what every engine shares and the machine, compare's
statistics (evalkit/compare/statistics/) nothing of its pages or of --locate, each benchmark only what the
benchmarks share (benchmarks/common/), and nothing imports in a cycle, not even inside a function. Checked by
import-linter over the package's imports, with no exception list. Run: pytest tests/test_architecture.py"""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
               "sys.exit(lint_imports_command())", "--no-cache", "--config", str(root / "pyproject.toml")]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, env={"PYTHONPATH": str(root),
                          "PATH": "/usr/bin:/bin"})


def test_the_contracts_are_the_stages_and_no_cycle_with_no_exceptions():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = {c["id"]: c for c in config["contracts"]}
    assert contracts["stages"]["type"] == "layers" and contracts["acyclic"]["type"] == "acyclic_siblings"
    assert contracts["stages"]["layers"][-2:] == ["config | contracts | versions", "errors"]
    assert contracts["engines"]["type"] == "layers" and contracts["engines"]["containers"] == ["evalkit.engine"]
    assert contracts["benchmarks"]["layers"][-1] == "common" and "benchmarks" in contracts["acyclic"]["ancestors"]
    assert "vllm | served | hf" in contracts["engines"]["layers"]
    assert contracts["compare"]["containers"] == ["evalkit.compare"] and contracts["compare"]["layers"][-1] == "runs"
    assert "locate | statistics" in contracts["compare"]["layers"]
    assert not any("ignore_imports" in c or "unmatched_ignore_imports_alerting" in c for c in contracts.values())


def test_every_benchmark_is_in_the_benchmarks_contract():
    """A benchmark left out of the contract's top layer would escape it: it could import another benchmark."""
    contract = next(c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
                    if c["id"] == "benchmarks")
    listed = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in (ROOT / "benchmarks").iterdir() if (p / "__init__.py").exists()}
    assert modules == listed


def test_the_package_keeps_its_contracts():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 kept, 0 broken" in result.stdout


def copy(to: Path) -> None:
    """The package, the benchmarks and the contracts, into to."""
    for name in ("evalkit", "benchmarks"):
        shutil.copytree(ROOT / name, to / name, ignore=shutil.ignore_patterns("__pycache__", "tasks", "*.md"))
    shutil.copy(ROOT / "pyproject.toml", to)


def test_an_upward_import_or_a_cycle_breaks_them_even_inside_a_function(tmp_path):
    """The check is not vacuous: a copy of the package with a harness module reaching up into run/, and a
    function-level import that closes a cycle inside engine/, fails both contracts."""
    copy(tmp_path)
    with open(tmp_path / "evalkit" / "harness" / "budget.py", "a") as f:
        f.write("\n\ndef upward():\n    from evalkit.run import results  # noqa: F401\n")
    with open(tmp_path / "evalkit" / "engine" / "factory.py", "a") as f:
        f.write("\n\ndef cycle():\n    from evalkit.engine.tokenizer import load_tokenizer  # noqa: F401\n")
    with open(tmp_path / "evalkit" / "engine" / "tokenizer.py", "a") as f:
        f.write("\n\ndef cycle():\n    from evalkit.engine import factory  # noqa: F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "3 kept, 3 broken" in result.stdout, result.stdout + result.stderr
    assert "evalkit.harness.budget -> evalkit.run.results" in result.stdout
    assert ".tokenizer -> .factory" in result.stdout


def test_an_engine_kind_reaching_into_another_breaks_the_engine_contract(tmp_path):
    """The served engine importing the vLLM engine's internals, even inside a function, fails the contract on
    the engine's rooms, and only that one (vLLM's engine imports nothing of the served one: no cycle)."""
    copy(tmp_path)
    with open(tmp_path / "evalkit" / "engine" / "served" / "engine.py", "a") as f:
        f.write("\n\ndef sideways():\n    from evalkit.engine.vllm import engine  # noqa: F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "5 kept, 1 broken" in result.stdout, result.stdout + result.stderr
    assert "evalkit.engine.served.engine -> evalkit.engine.vllm.engine" in result.stdout


def test_a_benchmark_importing_another_breaks_the_benchmarks_contract(tmp_path):
    """A benchmark reaching into another (even inside a function) fails the benchmarks' contract, and only that
    one: what benchmarks share belongs in benchmarks/common/."""
    copy(tmp_path)
    with open(tmp_path / "benchmarks" / "chain_cost.py", "a") as f:
        f.write("\n\ndef sideways():\n    from benchmarks import served  # noqa: F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "5 kept, 1 broken" in result.stdout, result.stdout + result.stderr
    assert "benchmarks.chain_cost -> benchmarks.served" in result.stdout


def test_the_statistics_reaching_into_locate_breaks_the_compare_contract(tmp_path):
    """compare's statistics importing --locate's analysis (even inside a function) fails the contract on compare's
    rooms, and only that one: the statistics and --locate share only the runs below them."""
    copy(tmp_path)
    with open(tmp_path / "evalkit" / "compare" / "statistics" / "tost.py", "a") as f:
        f.write("\n\ndef sideways():\n    from evalkit.compare.locate import why  # noqa: F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "5 kept, 1 broken" in result.stdout, result.stdout + result.stderr
    assert "evalkit.compare.statistics.tost -> evalkit.compare.locate.why" in result.stdout
