"""Issue 29's newcomer's walk, item by item, through the real commands: each test repeats what a
new user did and checks what they should have seen."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    REPO,
    error_report,
    last_checkpoint,
    offline_env,
    run_train,
    run_train_many,
    tiny_run,
)
from trainkit.checkpoint.contents import check_weights_fit
from trainkit.core.errors import LINE_LIMIT, TrainkitError
from trainkit.entry import cli
from trainkit.models import MnistNet

FLAT = ("model._target_=tests.dist.nets.FlatNet", "~model.widths", "trainer.precision=32")


def _flat(run_dir: Path, root: Path, *extra: str) -> list[str]:
    """A few steps of a small perceptron on the fake MNIST files (16 steps an epoch)."""
    return tiny_run(run_dir, root, *FLAT, *extra)


@pytest.fixture(scope="module")
def run6(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path) -> Path:
    """A completed run of 6 steps, inside its first epoch of 16."""
    run_dir = tmp_path_factory.mktemp("run6")
    result = run_train(*_flat(run_dir, mnist_root, "trainer.max_steps=6"))
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env or offline_env(),
                          capture_output=True, text=True, timeout=300)


def test_make_loader_for_cuda_without_cuda_fails_on_the_device_not_pinning() -> None:
    """The README's library snippet, ``make_loader(..., device="cuda")``, on a CPU machine."""
    script = ("import torch; from torch.utils.data import TensorDataset; "
              "from trainkit import make_loader; "
              "make_loader(TensorDataset(torch.zeros(8, 2)), 4, shuffle=True, device='cuda')")
    result = _run("-c", script, env=offline_env(CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 1
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("trainkit.core.errors.TrainkitError: device 'cuda' requested but "
                           "CUDA is not available"), result.stderr
    assert "pin_memory" not in result.stderr


@pytest.mark.dist
def test_the_launcher_relays_a_bad_input_status_and_ends_with_the_workers_line(
        tmp_path: Path, mnist_root: Path) -> None:
    bad = _run("-m", "trainkit.launch", "--nproc-per-node=1",
               *_flat(tmp_path / "run", mnist_root, "trainer.max_epochs=-3"),
               env=offline_env(CUDA_VISIBLE_DEVICES=""))
    assert bad.returncode == 2, bad.stderr[-2000:]  # bad input, as one process says it
    _, last = error_report(bad.stderr)  # no FAILED block, no torchrun log line after it
    assert last == "trainkit: trainer.max_epochs must be >= 1, got -3"


@pytest.mark.dist
def test_the_launcher_relays_a_preempted_status_and_ends_with_the_workers_line(
        tmp_path: Path, mnist_root: Path) -> None:
    """The worker signals itself at its 3rd step: it saves and exits 75, and so does the
    launcher (tests/dist/test_launch.py has the 2-process case)."""
    run_dir = tmp_path / "run"
    stopped = subprocess.run(
        [sys.executable, "-m", "trainkit.launch", "--nproc-per-node=1",
         *_flat(run_dir, mnist_root, "trainer.max_steps=8", "+model.fault=sigterm",
                "+model.fault_rank=0", "+model.fault_at=3")],
        cwd=REPO, env=offline_env(CUDA_VISIBLE_DEVICES=""), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300)
    assert stopped.returncode == 75, stopped.stdout[-3000:]
    assert "FAILED" not in stopped.stdout and "exitcode" not in stopped.stdout
    assert stopped.stdout.rstrip().splitlines()[-1].endswith(
        "stopped at step 3; re-run the same command to resume")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "preempted"


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path,
             run6: Path) -> tuple[Path, dict[str, subprocess.CompletedProcess[str]]]:
    """The walk's two runs of bad input, in one process (:func:`run_train_many`), each in its
    own folder under the first: "other" (MnistNet from a checkpoint of the perceptron, into
    ``other``) and "offline" (MNIST to download offline, into ``data`` and ``run``)."""
    folder = tmp_path_factory.mktemp("bad_runs")
    ckpt = run6 / "checkpoints" / "last.pt"
    offline = folder / "offline"
    runs = {"other": tiny_run(folder / "other", mnist_root, "trainer.precision=32",
                              f"checkpoint.init_from={ckpt}"),
            "offline": ["+exp=mnist", f"hydra.run.dir={offline / 'run'}",
                        f"data.root={offline / 'data'}", "trainer.precision=32"]}
    return folder, run_train_many(runs, folder / "results")


def test_init_from_another_model_counts_the_names_whole_and_leaves_no_folder(
        bad_runs: tuple[Path, dict[str, subprocess.CompletedProcess[str]]], run6: Path) -> None:
    other, result = bad_runs[0] / "other", bad_runs[1]["other"]
    assert result.returncode == 2
    _, last = error_report(result.stderr)
    here, saved = MnistNet().state_dict(), last_checkpoint(run6)["model"]
    missing = re.search(r"(\d+) missing in the checkpoint \(([^)]*)\)", last)
    assert missing and int(missing[1]) == len(here) == 20, last
    names = missing[2].removesuffix(", ...").split(", ")
    assert names and all(name in here for name in names), last  # whole names, none cut
    assert f"{len(saved)} extra" in last and " ... " not in last
    assert not other.exists()  # no empty run folder (no train.log, no checkpoints/) left


def test_a_misfit_of_long_names_stays_within_the_line_limit() -> None:
    here = {f"backbone.stage{i}.block{j}.downsample.conv.weight": torch.zeros(2)
            for i in range(4) for j in range(4)}
    saved = {f"encoder.stage{i}.block{j}.attention.qkv.weight": torch.zeros(2)
             for i in range(3) for j in range(4)}
    saved["backbone.stage0.block0.downsample.conv.weight"] = torch.zeros(3)
    for key in ("checkpoint.resume", "checkpoint.init_from"):
        with pytest.raises(TrainkitError) as err:
            check_weights_fit(here, saved, key=key, path="x.pt")
        line = f"trainkit: rank 0: {str(err.value).replace('run_dir', 'hydra.run.dir')}"
        assert len(line) <= LINE_LIMIT, line
        assert "15 missing in the checkpoint" in line and "12 extra" in line
        assert "1 of another shape" in line
        listed = re.findall(r"\(([^)]*)\)", line)
        assert all(name in {*here, *saved} for group in listed
                   for name in group.removesuffix(", ...").split(", ")), line


def test_consolidate_on_a_run_of_single_files_says_nothing_needs_it(
        tmp_path: Path, run6: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, last_pt = tmp_path / "model.pt", run6 / "checkpoints" / "last.pt"
    result = _run("-m", "trainkit", "checkpoint", "consolidate", str(run6), str(out))
    assert result.returncode == 2
    _, last = error_report(result.stderr)
    # whole in the last line, or (a long temporary path) in the detail line above its shortening
    assert f"this run's checkpoints are single files already (newest: {last_pt})" in result.stderr
    assert "single files already" in last
    assert "nothing needs consolidating" in last and "checkpoints/last " not in last
    # its checkpoints folder, and the file itself (in this process: the same command)
    for source, words in ((run6 / "checkpoints", "single files already"),
                          (last_pt, "is a single-file checkpoint already")):
        assert cli.main(["checkpoint", "consolidate", str(source), str(out)]) == 2
        _, last = error_report(capsys.readouterr().err)
        assert words in last and "nothing needs consolidating" in last, last
    assert not out.exists()


def test_the_built_wheel_folder_is_ignored_by_git() -> None:
    """README: ``pip wheel --no-deps . -w dist`` puts the wheel in dist/."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    wheel = "dist/trainkit-1.0-py3-none-any.whl"
    result = subprocess.run(["git", "check-ignore", "--no-index", wheel], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command", ["launch", "data", "env", "checkpoint", "verify-resume",
                                     "sweep", "runs"])
def test_console_subcommands_name_themselves_in_their_usage(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: trainkit {command} ")
    # the module form keeps its own name
    module = __import__(cli.COMMANDS[command][0], fromlist=["main"])
    with pytest.raises(SystemExit):
        module.main(["--help"])
    assert capsys.readouterr().out.startswith(
        f"usage: python -m {cli.COMMANDS[command][0].removesuffix('.__main__')} ")


def test_rerunning_a_completed_run_says_so_and_changes_nothing(
        tmp_path: Path, mnist_root: Path, run6: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(run6, run_dir)
    files = sorted(p for p in run_dir.rglob("*") if p.is_file() and p.name != "train.log"
                   and ".hydra" not in p.parts)
    before = {p: p.read_bytes() for p in files}
    again = run_train(*_flat(run_dir, mnist_root, "trainer.max_steps=6"))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "the run is complete at step 6 of 6" in again.stdout
    assert "training " not in again.stdout and "val/loss" not in again.stdout  # no evaluation
    after = sorted(p for p in run_dir.rglob("*") if p.is_file() and p.name != "train.log"
                   and ".hydra" not in p.parts)
    assert after == files  # no new checkpoint, event file or summary
    assert all(p.read_bytes() == before[p] for p in files)  # metrics.jsonl, summary.json too


def test_summary_epoch_is_the_one_train_log_names(run6: Path) -> None:
    """6 steps of an epoch of 16: the log says epoch 1, and so does summary.json."""
    log = (run6 / "train.log").read_text()
    assert "epoch 1 step 6/6" in log and "epoch 1 step 6 val/loss" in log
    summary = json.loads((run6 / "summary.json").read_text())
    assert (summary["epoch"], summary["global_step"]) == (1, 6)


def test_offline_download_error_says_each_thing_once_and_leaves_no_folder(
        bad_runs: tuple[Path, dict[str, subprocess.CompletedProcess[str]]]) -> None:
    root, run_dir = bad_runs[0] / "offline" / "data", bad_runs[0] / "offline" / "run"
    result = bad_runs[1]["offline"]
    assert result.returncode == 2
    details, last = error_report(result.stderr)
    assert "MNIST not found under data.root (the download failed)" in last
    assert result.stderr.count("Connection refused") == 1, result.stderr  # both mirrors: once
    assert len(set(details)) == len(details)
    assert not root.exists() and not run_dir.exists()
    # CIFAR-10's urllib error and its cause say the same: once
    result = _run("-m", "trainkit", "data", "download", "cifar10", "--root", str(root))
    assert result.returncode == 2
    details, last = error_report(result.stderr)
    assert result.stderr.count("Connection refused") == 1, result.stderr
    assert not root.exists()


def test_a_signal_during_the_epoch_end_evaluation_stops_before_another_step(
        tmp_path: Path, mnist_root: Path) -> None:
    run_dir = tmp_path / "run"
    command = tiny_run(run_dir, mnist_root, "trainer.precision=32", "~model.widths",
                       "model._target_=tests.integration.signal_nets.EvalSignalNet",
                       f"+model.once={tmp_path / 'signalled'}", "trainer.max_epochs=2",
                       "trainer.max_steps=20", "trainer.log_every_n_steps=1")
    stopped = run_train(*command)
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    assert "epoch 1 step 16 val/loss" in stopped.stdout  # the evaluation ran to its end
    assert "step 17/20" not in stopped.stdout  # and no step after it
    assert last_checkpoint(run_dir)["global_step"] == 16
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["global_step"]) == ("preempted", 16)
    again = run_train(*command)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 20


def test_a_stopped_run_in_hydras_default_folder_resumes_with_the_command_it_printed(
        tmp_path: Path, mnist_root: Path) -> None:
    """No hydra.run.dir: the same command would start a new outputs/<date>/<time>. The start
    names the folder, and the stop line gives the command that resumes it there."""
    # the model signals its own process (SIGTERM) at its 3rd training forward, in every attempt
    overrides = ["+exp=mnist", f"data.root={mnist_root}", "data.verify=false",
                 "data.download=false", "data.batch_size=32", "trainer.log_every_n_steps=1",
                 *FLAT, "+model.fault=sigterm", "+model.fault_rank=0", "+model.fault_at=3",
                 "trainer.max_steps=8"]

    def train(command: list[str]) -> tuple[Path, str]:
        result = subprocess.run(command, cwd=tmp_path, env=offline_env(PYTHONPATH=str(REPO)),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                timeout=300)
        assert result.returncode == 75, result.stdout[-3000:]
        run_dirs = [p.parent for p in tmp_path.glob("outputs/*/*/summary.json")]
        assert len(run_dirs) == 1, run_dirs  # one folder, also after the resume
        return run_dirs[0], result.stdout

    run_dir, said = train([sys.executable, "-m", "trainkit.train", *overrides])
    # issue 61, fault 5: the command runs as typed, also where `python` is not this environment's
    program = f"{shlex.quote(sys.executable)} -m trainkit.train"
    assert f"run dir {run_dir}; after a stop, resume with: {program} " in said
    last = said.rstrip().splitlines()[-1]
    assert f"stopped at step 3; resume with: {program} " in last, last
    command = shlex.split(last.split("resume with: ", 1)[1])
    assert command[:3] == [sys.executable, "-m", "trainkit.train"]
    assert command[-1] == f"hydra.run.dir={run_dir}"
    again, said = train(command)  # as printed
    assert again == run_dir
    assert "resumed from" in said and "at step 3" in said
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 6


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones included): its relative name and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_a_refused_start_leaves_a_finished_run_folder_byte_for_byte(
        tmp_path: Path, mnist_root: Path, cifar_root: Path, run6: Path) -> None:
    """Issue 61, fault 1: each kind of refused start (another experiment's data, a bad value, a
    misspelt key, missing data) in a copy of a finished run: its folder afterwards holds the same
    files with the same bytes, Hydra's ``.hydra/`` records included."""
    runs: dict[str, list[str]] = {
        "other_experiment": ["+exp=cifar", f"data.root={cifar_root}", "data.verify=false",
                             "data.download=false", "data.batch_size=32",
                             "trainer.precision=32", "trainer.max_steps=12"],
        "bad_value": _flat(Path(), mnist_root, "trainer.max_epochs=-3")[1:],
        "bad_key": _flat(Path(), mnist_root, "trainer.max_stepz=3")[1:],
        "missing_data": _flat(Path(), tmp_path / "no_data", "trainer.max_steps=12")[1:],
    }
    folders = {name: tmp_path / name for name in runs}
    for name, folder in folders.items():
        shutil.copytree(run6, folder)
        runs[name] = [*runs[name], f"hydra.run.dir={folder}"]
    before = _tree(run6)
    assert ".hydra/config.yaml" in before and "summary.json" in before
    results = run_train_many(runs, tmp_path / "results")
    for name, result in results.items():
        assert result.returncode == 2, (name, result.stderr[-2000:])
        assert _tree(folders[name]) == before, name


def test_the_finetuning_guides_three_commands_start_with_the_folder_recipe() -> None:
    """Issue 61, fault 9: not the default one-cycle recipe, which the README says diverges on
    photos, but ``+exp=folder``."""
    from tests.integration.test_doc_recipes import bash_block

    block = bash_block(REPO / "docs" / "finetuning.md", "model.pretrained=runs/big_export")
    commands = [line for line in block.splitlines() if line.startswith("python -m trainkit")]
    assert commands[0].split()[3] == "+exp=folder", commands
    assert "data=image_folder" not in block


def _dev_only_packages() -> set[str]:
    """The dev extra's packages (its ``trainkit[...]`` extras expanded) that training does not
    need: not among pyproject.toml's runtime dependencies."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(requirements: list[str]) -> set[str]:
        found = set()
        for requirement in requirements:
            name = re.match(r"[A-Za-z0-9_.-]+", requirement)[0].lower()
            if name == "trainkit":
                for extra in re.search(r"\[(.*)\]", requirement)[1].split(","):
                    found |= names(extras[extra.strip()])
            else:
                found.add(name)
        return found

    return names(extras["dev"]) - names(project["dependencies"])


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_train_installs_no_package_of_the_dev_extra_and_says_what_it_installs() -> None:
    """Issue 61, fault 7: ``make train`` on a fresh clone (``-B``: as if nothing were installed)
    installs trainkit with its runtime dependencies only, says what and for how long, with pip's
    progress shown; ``make test`` then adds the dev extra."""
    def dry_run(target: str) -> str:
        return subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True,
                              text=True, timeout=60, check=True).stdout

    dev_only = _dev_only_packages()
    assert {"pytest", "ruff", "moto", "mlflow-skinny", "wandb", "transformers", "optuna",
            "scikit-image", "nbclient"} <= dev_only
    train = dry_run("train")
    installs = [line for line in train.splitlines() if "-m pip install" in line]
    assert installs and not any("--quiet" in line for line in installs), installs
    words = set(re.findall(r"[\w.\[\]'-]+", " ".join(installs)))
    assert not words & dev_only and not any("[dev]" in w for w in words), installs
    assert "installing into .venv what training needs" in train and "minutes" in train
    test = dry_run("test")
    assert "-e '.[dev]'" in test and "adding the dev extra" in test and "minutes" in test
