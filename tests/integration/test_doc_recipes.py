"""Shell recipes of the docs, taken from the docs' own text and run in a shell as written.

Only what a CPU can run changes: the fake data and a few steps are appended to the command, and
a shell function stands in for `python` where a recipe's logic, not training, is under test.
Every command of the README's ```bash blocks is listed below with the test that runs it.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, offline_env

LONG_RUNNING = REPO / "docs" / "long-running-jobs.md"
README = REPO / "README.md"


def bash_block(doc: Path, marker: str) -> str:
    """The one recipe of ``doc`` that contains ``marker``: a ```bash block, or the paragraph of
    one (its recipes are separated by blank lines)."""
    blocks = re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)
    found = [p for b in blocks for p in b.split("\n\n") if marker in p]
    assert len(found) == 1, f"{len(found)} recipes of {doc.name} contain {marker!r}"
    return found[0]


def retry_loop(marker: str) -> str:
    """The docs' retry loop (``until ...; do ... done``) from the block that holds ``marker``."""
    block = bash_block(LONG_RUNNING, marker)
    loop = re.search(r"^until .*?^done$", block, re.S | re.M)
    assert loop, block
    return loop.group(0)


# `python` as a shell function: each call is one "run" that exits with the next status listed.
FAKE_RUNS = '''statuses=({statuses}); runs=0
python() {{ runs=$((runs + 1)); echo "run $runs"; return ${{statuses[runs - 1]}}; }}
'''


def run_loop(loop: str, statuses: list[int], *shell_flags: str) -> tuple[int, int]:
    """Run ``loop`` as the end of a job script; return its exit status and how many runs."""
    script = FAKE_RUNS.format(statuses=" ".join(map(str, statuses))) + loop + "\n"
    proc = subprocess.run(["bash", *shell_flags, "-c", script], capture_output=True, text=True,
                          timeout=60)
    return proc.returncode, proc.stdout.count("run ")


@pytest.mark.parametrize("flags", [(), ("-e",)], ids=["plain", "set-e"])
def test_retry_loop_passes_on_a_real_error(flags: tuple[str, ...]) -> None:
    loop = retry_loop("hydra.run.dir=runs/cifar; do")
    assert run_loop(loop, [75, 75, 3], *flags) == (3, 3)  # resumed twice, then the error's 3
    assert run_loop(loop, [1], *flags) == (1, 1)
    assert run_loop(loop, [75, 0], *flags) == (0, 2)  # preempted, resumed, completed
    assert run_loop(loop, [0], *flags) == (0, 1)


def test_hang_retry_loop_passes_on_a_real_error() -> None:
    loop = retry_loop("trainer.hang_action=abort; do")
    assert run_loop(loop, [124, 75, 2]) == (2, 3)  # hung, preempted, then an error
    assert run_loop(loop, [124, 0]) == (0, 2)


def test_retry_loop_in_parentheses_keeps_the_prompt() -> None:
    """What the doc says to type at a prompt: the shell survives and $? is the error's."""
    loop = retry_loop("hydra.run.dir=runs/cifar; do")
    script = FAKE_RUNS.format(statuses="75 3") + f"( {loop} )\necho \"after $?\"\n"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[-1] == "after 3", proc.stdout


@pytest.mark.slow
def test_nohup_recipe_on_a_fresh_folder(tmp_path: Path, mnist_root: Path) -> None:
    """The nohup block, from a folder without runs/: the output file can be made, and tail
    follows train.log although the run creates it only after tail has started."""
    block = bash_block(LONG_RUNNING, "nohup python")
    fast = (f"hydra.run.dir=runs/mnist data.root={mnist_root} data.verify=false "
            "data.download=false data.batch_size=64 trainer.max_steps=6 "
            "trainer.log_every_n_steps=2 trainer.precision=32")
    script = block.replace("hydra.run.dir=runs/mnist", fast, 1)
    assert script != block
    env = offline_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env["PYTHONPATH"] = str(REPO)  # this checkout's trainkit, also where it is not installed
    shell = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    followed = b""
    deadline = time.monotonic() + 300
    try:  # tail's output; `tail -f` would end at once, before the run has made its log
        while b"done: test accuracy" not in followed:
            if not select.select([shell.stdout], [], [], deadline - time.monotonic())[0]:
                break  # the run failed (its reason is in runs/mnist.out) or is far too slow
            chunk = os.read(shell.stdout.fileno(), 1 << 16)
            if not chunk:
                break  # tail ended
            followed += chunk
    finally:
        os.killpg(shell.pid, signal.SIGKILL)  # tail follows forever
        shell.wait()
    out = tmp_path / "runs" / "mnist.out"
    text = followed.decode()
    assert "done: test accuracy" in text, (
        text + (out.read_text() if out.is_file() else "(no runs/mnist.out)"))
    assert " step 6/6 " in text, text
    assert (tmp_path / "runs" / "mnist" / "summary.json").is_file()
    assert "training " in out.read_text()


def readme_commands() -> set[str]:
    """Every command of the README's ```bash blocks: comments dropped, continued lines joined,
    spaces normalised."""
    commands = set()
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
            if command:
                commands.add(command)
    return commands


_ENTRY = "tests/integration/test_train_entry.py::"
_HERE = "tests/integration/test_doc_recipes.py::"
_AFTER = "tests/integration/test_after_training.py::"
# Each command the README shows -> the test that runs it (on fake data, a few steps: the rest of
# the command as written) and a string that test's file holds where it builds the command.
README_RUN_BY = {
    "make train": (_HERE + "test_make_targets_run_what_the_readme_says", "train"),
    "make test": (_HERE + "test_make_targets_run_what_the_readme_says", "test"),
    "make bench": (_HERE + "test_make_targets_run_what_the_readme_says", "bench"),
    '.venv/bin/pytest -m "not slow"': (_HERE + "test_make_targets_run_what_the_readme_says",
                                       "slow"),
    "python -m trainkit.data download mnist cifar10 --root /data": (
        "tests/integration/test_cifar_exp.py::test_data_command_verify_reports_bad_and_missing",
        '"download"'),
    "python -m trainkit.data verify --root /data": (
        "tests/integration/test_cifar_exp.py::test_data_command_verify_reports_bad_and_missing",
        '"verify"'),
    # a wheel, built from a clean copy and installed: what `pip install .` does
    "pip install .": ("tests/integration/test_install.py::test_installed_wheel_trains_from_an_"
                      "empty_folder", '"install"'),
    "pip install -e .": ("Makefile::install", "-c .ci/constraints.txt -e .\n"),
    "pip wheel --no-deps . -w dist && pip install dist/trainkit-*.whl": (
        "tests/integration/test_install.py::test_wheel_holds_every_module_and_config", '"wheel"'),
    "cd /anywhere": ("tests/integration/test_install.py::test_installed_wheel_trains_from_an_"
                     "empty_folder", '"anywhere"'),
    "python -m trainkit.train +exp=mnist --info searchpath": (
        _HERE + "test_readme_info_searchpath_from_another_folder", "--info"),
    "python -m trainkit.train +exp=mnist": (_ENTRY + "test_summary_follows_the_contract",
                                            '"+exp=mnist"'),
    "python -m trainkit.train +exp=finetune_image data.root=/data/pets "
    "model.pretrained=resnet18.pth": (
        "tests/integration/test_finetune_image.py::test_the_finetuned_resnet18_replaces_its_head_"
        "trains_it_alone_first_and_beats_random", '"+exp=finetune_image"'),
    "python -m trainkit.train +exp=cifar": (
        "tests/integration/test_cifar_exp.py::test_cifar_experiment_trains_on_cifar_format_files",
        '"+exp=cifar"'),
    # every test's tiny run sets the precision (and its batch size) so
    "python -m trainkit.train +exp=mnist trainer.precision=32 data.batch_size=256": (
        "tests/conftest.py::tiny_run", "trainer.precision=32"),
    "python -m trainkit.train -m +exp=mnist optim.lr=0.01,0.05": (
        _ENTRY + "test_multirun_sweeps_learning_rates", "optim.lr=0.01,0.05"),
    "python -m trainkit.train +exp=mnist hydra.run.dir=runs/a": (
        _ENTRY + "test_rerun_in_same_dir_resumes_and_matches_an_uninterrupted_run",
        "hydra.run.dir"),
    "python -m trainkit.train +exp=mnist --cfg job": (
        "tests/integration/test_install.py::test_installed_wheel_trains_from_an_empty_folder",
        '"--cfg", "job"'),
    "cd examples/own_configs": (
        "tests/integration/test_own_configs.py::test_own_experiment_trains_its_own_model_on_its_"
        "own_dataset", '"own_configs"'),
    "python -m trainkit.train +exp=mine 'hydra.searchpath=[file://my_configs]'": (
        "tests/integration/test_own_configs.py::test_own_experiment_trains_its_own_model_on_its_"
        "own_dataset", "hydra.searchpath=[file://my_configs]"),
    # on 2 CPU processes; several nodes need several machines: one node runs the same job
    "torchrun --standalone --nproc-per-node=4 -m trainkit.train +exp=cifar": (
        "tests/dist/test_torchrun.py::test_two_ranks_write_one_run_and_train_like_one_process_"
        "with_twice_the_batch", '"--standalone"'),
    "torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=host0:29500 -m "
    "trainkit.train +exp=cifar hydra.run.dir=/shared/runs/c1": (
        "tests/dist/test_torchrun.py::test_two_ranks_write_one_run_and_train_like_one_process_"
        "with_twice_the_batch", '"torch.distributed.run"'),
    "python -m trainkit.launch +exp=cifar": (
        "tests/dist/test_launch.py::test_launch_module_starts_torchrun_with_one_process_on_cpu",
        '"trainkit.launch"'),
    "python -m trainkit.env": (
        "tests/unit/entry/test_env.py::test_report_lists_versions_and_passes_sanity_check",
        '"trainkit.env"'),
    "python -m trainkit.env --device cuda": (
        "tests/unit/entry/test_env.py::test_unavailable_device_is_one_line_and_nonzero",
        '"cuda"'),
    "python -m trainkit.train +exp=folder data.root=/data/pets": (
        "tests/integration/test_image_folder.py::test_folder_experiment_and_resnet18_train_with_"
        "nothing_else_set", '"+exp=folder"'),
    "python -m trainkit.data tokenize my_texts/ corpus/ --tokenizer bytes": (
        "tests/integration/test_lm_entry.py::corpus", '"tokenize"'),
    "python -m trainkit.train +exp=lm data.root=corpus": (
        "tests/integration/test_lm_entry.py::test_lm_learns_logs_its_scalars_and_resumes_"
        "bitwise_after_sigterm", '"+exp=lm"'),
    "torchrun --standalone --nproc-per-node=2 -m trainkit.train +exp=lm data.root=corpus": (
        "tests/dist/test_lm_torchrun.py::test_lm_trains_under_torchrun_with_two_ranks",
        '"--nproc-per-node=2"'),
    "python -m trainkit.data shards /data/pets /data/pets-shards --samples-per-shard 1000": (
        "tests/integration/test_shards_entry.py::test_shards_then_the_entry_point_trains_on_them",
        '"--samples-per-shard"'),
    "python -m trainkit.train +exp=folder data=webdataset data.root=/data/pets-shards": (
        "tests/integration/test_shards_entry.py::test_shards_then_the_entry_point_trains_on_them",
        '"data=webdataset"'),
    # after training (tests/integration/test_after_training.py's tiny run)
    "trainkit evaluate runs/a": (
        _AFTER + "test_the_readmes_evaluate_line_takes_best_where_kept_else_last",
        '["evaluate", str(copy)]'),
    "trainkit predict runs/a inputs=my_images out=predictions.jsonl": (
        _AFTER + "test_predict_over_a_folder_of_50_images_writes_50_rows_in_order",
        '"predict", str(run), f"inputs={folder}", f"out={out}"'),
    "trainkit export runs/a --format pt2": (
        _AFTER + "test_export_pt2_runs_with_torch_alone_and_gives_trainkits_logits",
        '"--format", "pt2"'),
    "trainkit export runs/a --format safetensors --out model_export": (
        _AFTER + "test_image_folder_resnet_run_predicts_and_exports_what_its_own_loader_"
        "evaluates",
        '"--format", "safetensors"'),
    "torchrun --nproc-per-node=2 --no-python trainkit predict runs/a inputs=my_images "
    "out=predictions.jsonl": (
        "tests/dist/test_after_training_fsdp.py::test_predict_on_two_ranks_writes_the_rows_of_"
        "one_process_in_order", '"trainkit.entry.predict"'),
    "trainkit sweep --trials 20 --jobs 2 --dir sweeps/lr +exp=mnist +sweep=lr": (
        "tests/integration/test_sweep.py::test_readme_sweep_trains_each_trial_and_runs_lists_"
        "them_best_first", '"trainkit sweep"'),
    "trainkit runs sweeps/lr": (
        "tests/integration/test_sweep.py::test_readme_sweep_trains_each_trial_and_runs_lists_"
        "them_best_first", '"trainkit runs"'),
    "python -m trainkit.train +exp=finetune_text model.path=my_bert data.root=my_texts": (
        "tests/integration/test_finetune_text.py::test_lora_fine_tuning_learns_and_changes_"
        "only_the_adapters_and_head", '"+exp=finetune_text"'),
    ".venv/bin/python -m benchmarks --quick": (
        "tests/integration/test_benchmarks.py::test_runner_quick_writes_json_and_table",
        '"--quick"'),
}


def test_every_readme_command_is_run_by_a_test() -> None:
    shown = readme_commands()
    assert shown == set(README_RUN_BY), (
        f"README commands without a test here: {sorted(shown - set(README_RUN_BY))}; "
        f"listed but no longer shown: {sorted(set(README_RUN_BY) - shown)}")
    for command, (where, holds) in README_RUN_BY.items():
        path, name = where.split("::")
        text = (REPO / path).read_text()
        defines = f"def {name}(" if path.endswith(".py") else f"\n{name}:"
        assert defines in text, f"{command!r}: {where} not found"
        assert holds in text, f"{command!r}: {path} does not hold {holds!r}"


def test_the_readmes_own_data_commands_start_from_the_recipe_made_for_them() -> None:
    """`data=image_folder` alone keeps MNIST's recipe (one-cycle lr 0.01, fp32): a newcomer's
    ResNet on photos ended its first epoch at val/loss 242,503, against 1.36 with +exp=folder.
    The recipes made for own images: +exp=folder, and +exp=finetune_image from weights."""
    own = [c for c in readme_commands()
           if "trainkit.train" in c and re.search(r"data\.root=/data/\S+(\s|$)", c)]
    assert own, "no command of the README trains on data of one's own"
    assert all(re.search(r"\+exp=(folder|finetune_image)(\s|$)", command) for command in own), own


def test_make_targets_run_what_the_readme_says() -> None:
    """`make train ARGS=...`, `make test` and `make bench` run the commands the README names, and
    `pytest -m "not slow"` selects by a registered marker."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shown = subprocess.run(["make", "-n", "train", "test", "bench", "ARGS=data.batch_size=256"],
                           cwd=REPO, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "-m trainkit.train +exp=mnist data.batch_size=256" in shown, shown
    assert "-m ruff check ." in shown and "-m pytest" in shown, shown
    # the suite in two workers, then the tests that measure time alone
    assert '-m pytest -n 2 -m "not serial"' in shown and "-m pytest -m serial" in shown, shown
    assert '"serial: ' in (REPO / "pyproject.toml").read_text()
    assert "-m benchmarks" in shown and ".[bench]" in shown, shown
    assert '"slow: ' in (REPO / "pyproject.toml").read_text()
    # then the unit tests on the torch floor, the one pyproject.toml states
    floor = re.search(r'"torch>=([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert ".ci/floor_venv.sh " in shown and f'.venv-floor "torch=={floor}.0' in shown, shown
    assert ".venv-floor/bin/python -m pytest tests/unit" in shown, shown
    assert f"on torch {floor}" in README.read_text()


def test_readme_info_searchpath_from_another_folder(tmp_path: Path) -> None:
    """The README's command, as written, from a folder that is not the clone: trainkit's own
    configs are on the search path."""
    command = next(c for c in readme_commands() if c.endswith("--info searchpath"))
    env = offline_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                      PYTHONPATH=str(REPO))
    shown = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert f"file://{REPO / 'configs'}" in shown.stdout, shown.stdout
