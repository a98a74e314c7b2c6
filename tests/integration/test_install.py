"""A wheel and an sdist built from a clean copy of the tree, installed into a temporary target,
train from an empty folder: the configs travel inside the package."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, last_checkpoint, offline_env
from tests.helpers.fakes import write_fake_mnist

pytestmark = pytest.mark.slow

# What a clean clone does not have: environments, caches, build outputs, runs, data.
_TOP_LEVEL_ONLY = {".git", ".venv", "venv", "build", "dist", "outputs", "multirun", "runs", "data"}
_ANYWHERE = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache")


def _not_source(folder: str, names: list[str]) -> set[str]:
    top = {n for n in names if n in _TOP_LEVEL_ONLY} if Path(folder) == REPO else set()
    return top | _ANYWHERE(folder, names)


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env or offline_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


def _pip_wheel(source: Path, out: Path) -> Path:
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", out, source, cwd=source.parent)
    (wheel,) = out.glob("trainkit-*.whl")
    return wheel


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A wheel built from a clean copy of the tree, one built from its sdist, and the first
    installed into a target folder (``pip install --target``)."""
    base = tmp_path_factory.mktemp("install")
    source = base / "trainkit-src"
    shutil.copytree(REPO, source, ignore=_not_source)
    wheel = _pip_wheel(source, base / "wheel")
    sdist_name = _run(sys.executable, "-c", "import setuptools.build_meta as b; "
                      "print(b.build_sdist('sdist'))", cwd=source).stdout.split()[-1]
    with tarfile.open(source / "sdist" / sdist_name) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(base / "unpacked", **safe)
    (unpacked,) = (base / "unpacked").iterdir()
    from_sdist = _pip_wheel(unpacked, base / "wheel-from-sdist")
    target = base / "target"
    _run(sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
         target, wheel, cwd=base)
    return {"wheel": wheel, "from_sdist": from_sdist, "target": target}


def _names(wheel: Path) -> set[str]:
    return {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}


def test_wheel_holds_every_module_and_config(builds: dict[str, Path]) -> None:
    names = _names(builds["wheel"])
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "trainkit").rglob("*.py")}
    configs = {f"trainkit/{p.relative_to(REPO).as_posix()}"
               for p in (REPO / "configs").rglob("*.yaml")}
    assert modules - names == set(), "a subpackage is missing from pyproject's packages list"
    assert configs <= names and "trainkit/configs/exp/mnist.yaml" in names
    assert _names(builds["from_sdist"]) == names  # the sdist carries everything the wheel needs
    metadata = zipfile.ZipFile(builds["wheel"]).read(
        f"trainkit-{_version()}.dist-info/METADATA").decode()
    assert "License-Expression: MIT" in metadata and "Classifier: Programming Language" in metadata


def _version() -> str:
    from trainkit import __version__

    return __version__


def test_installed_wheel_trains_from_an_empty_folder(builds: dict[str, Path],
                                                     tmp_path: Path) -> None:
    target = builds["target"]
    work = tmp_path / "anywhere"
    write_fake_mnist(work / "data")
    env = offline_env(PYTHONPATH=str(target))  # the installed copy, not this checkout
    result = _run(sys.executable, "-m", "trainkit.train", "+exp=mnist", "trainer.max_steps=5",
                  "trainer.precision=32",
                  "data.verify=false", "data.download=false", "data.batch_size=32",
                  "hydra.run.dir=run", cwd=work, env=env)
    assert "done: test accuracy" in result.stdout
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 5
    assert last_checkpoint(work / "run")["manifest"]["trainkit"] == _version()
    hydra = yaml.safe_load((work / "run" / ".hydra" / "hydra.yaml").read_text())["hydra"]
    primary = [s["path"] for s in hydra["runtime"]["config_sources"] if s["provider"] == "main"]
    assert primary == [str(target / "trainkit" / "configs")]
    # the console command, with the CIFAR experiment composed from the packaged configs
    script = target / "bin" / "trainkit"
    shown = _run(script, "train", "+exp=cifar", "--cfg", "job", cwd=work, env=env)
    assert "_target_: trainkit.models.CifarNet" in shown.stdout
