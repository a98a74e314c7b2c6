"""The GPU check without a GPU: its script parses and skips in one line, and the cases that can
run on the CPU pass there, so the one run on a lent GPU does not fail on its own code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, offline_env, run_module

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def test_the_script_parses_and_without_cuda_skips_in_one_line(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the script would run every case")
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=tmp_path, capture_output=True,
                            text=True, env=offline_env(PYTHON=sys.executable), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == [
        "gpu_check: skipped: CUDA is not available on this machine"]
    usage = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "<out_dir>" in usage.stderr


def test_the_syncs_check_says_why_not_without_cuda() -> None:
    from benchmarks import syncs

    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    assert "CUDA" in syncs.main([])["skipped"]


def test_the_sync_count_check_passes_on_the_cpu() -> None:
    """The harness the GPU check runs under set_sync_debug_mode, with its read and sync counts,
    over pre-placed batches, through the real image loader (uint8 batches from files through
    make_loader, collate and the DevicePrefetcher; decode=gpu's JpegDecoder on the CPU), and
    over padded text in a counted window (token-normalised loss, real tokens/s)."""
    from benchmarks.syncs import measure

    result = measure(torch.device("cpu"), steps=6, log_every=3, loader_steps=4,
                     loader_log_every=2)
    assert result["failures"] == []
    runs = result["by_precision"]["16-mixed"]["runs"]
    assert runs[1]["host_reads"] > runs[0]["host_reads"]  # GradScaler's read per step, reported
    # 32, bf16-mixed, 16-mixed (GradScaler's read per step: not judged), 16-mixed+fused, the
    # loader with decode=cpu and gpu, and padded text in a counted window
    assert [r["met"] for r in result["rows"]] == [True, True, None, True, True, True, True]
    short, long_same_logs, long_more_logs = result["by_text"]["counted"]["runs"]
    assert short["host_syncs"] == long_same_logs["host_syncs"] == 0, long_same_logs
    assert long_more_logs["host_reads"] > long_same_logs["host_reads"]  # reads are seen
    for name in ("decode=cpu", "decode=gpu"):
        short, long_same_logs, long_more_logs = result["by_loader"][name]["runs"]
        assert short["global_step"] == 4 and long_same_logs["global_step"] == 8
        assert short["host_syncs"] == long_same_logs["host_syncs"] == 0, long_same_logs
        assert long_more_logs["host_reads"] > long_same_logs["host_reads"]  # reads are seen


def test_the_sync_count_sees_a_constant_built_per_batch(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    """c95d846 built normalize's constants with torch.tensor(list, device=...) on every batch: a
    blocking copy from pageable memory on CUDA. The count sees that pattern on the CPU too."""
    from benchmarks.syncs import loader_syncs
    from trainkit.data import transforms

    def per_batch(self: transforms.Normalize, images: torch.Tensor, **kwargs: object) -> object:
        torch.tensor(self.mean, device=images.device)  # the old code's pattern
        return own(self, images, **kwargs)

    own = transforms.Normalize.__call__
    monkeypatch.setattr(transforms.Normalize, "__call__", per_batch)
    runs = [loader_syncs(n, every, "cpu", tmp_path) for n, every in ((4, 2), (8, 4))]
    assert [r["syncs_by_call"] for r in runs] == [{"tensor": 4}, {"tensor": 8}]


@pytest.mark.slow
def test_resume_cases_pass_on_the_cpu(tmp_path: Path) -> None:
    """Real processes: a straight run; one stopped by SIGTERM and resumed; one saving in the
    background, stopped by its step limit and resumed. Bitwise equal to the straight run."""
    result = run_module("benchmarks.gpu_check", str(tmp_path), "--device", "cpu",
                        "--only", "sigterm_resume,async_save_resume", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert sorted(report["passed"]) == ["async_save_resume", "sigterm_resume"]
    case = report["cases"]["sigterm_resume"]
    assert 0 < case["stopped_at"] < case["global_step"] == 30
    assert case["largest_weight_difference"] == 0.0
    assert len(report["cases"]["async_save_resume"]["checkpoints_equal"]) == 6
    assert "gpu_check: 2 passed, 0 failed" in result.stdout


def _fake_nvidia_smi(folder: Path) -> str:
    """A PATH whose nvidia-smi lists one GPU (as on a machine whose torch or driver is broken)."""
    folder.mkdir()
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0000)'\n")
    smi.chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


def test_a_gpu_torch_cannot_use_fails_in_one_line(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi sees a GPU, torch does not: exit 1 (was: 'skipped', exit 0)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    path = _fake_nvidia_smi(tmp_path / "bin")
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True,
                            text=True, env=offline_env(PYTHON=sys.executable, PATH=path),
                            timeout=120)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stdout + result.stderr
    assert lines[0].startswith("gpu_check: FAIL: nvidia-smi sees 1 GPU(s) but torch cannot use")

    from benchmarks import gpu_check

    monkeypatch.setenv("PATH", path)
    with pytest.raises(SystemExit) as caught:
        gpu_check.main([str(tmp_path / "py")])
    assert caught.value.code == 1
    assert "FAIL: nvidia-smi sees 1 GPU(s)" in gpu_check.cuda_missing()


_NO_HYDRA = """
import sys
class NoHydra:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hydra", "omegaconf"):
            raise ImportError(f"no module named {name!r} (a GPU image without Hydra)")
sys.meta_path.insert(0, NoHydra())
"""


def test_no_hydra_and_no_wheels_fails_in_one_line(tmp_path: Path) -> None:
    """A GPU machine's Python (here: one whose CUDA check passes) without Hydra, no wheels."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_NO_HYDRA)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\ncase "$*" in *torch.cuda.init*) exit 0;; esac\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True,
        env=offline_env(PYTHON=str(python), PYTHONPATH=str(site),
                        WHEELS=str(tmp_path / "no_wheels")), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.strip().splitlines() == [
        f"gpu_check: FAIL: no Hydra here and no {tmp_path / 'no_wheels'}/ to install it from: "
        "run 'bash benchmarks/gpu_check.sh --fetch-wheels' where pip reaches PyPI, and bring "
        ".whl/"]


def test_gpu_tests_fail_when_a_gpu_marked_test_is_skipped(tmp_path: Path) -> None:
    """pytest exits 0 with skips: the case reads its report, not its exit status."""
    from benchmarks.gpu_check import CaseFailed, gpu_tests

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_a():\n    pass\n\n"
        "@pytest.mark.gpu\ndef test_b():\n    pytest.skip('needs nvJPEG')\n\n"
        "def test_not_gpu():\n    pytest.skip('not selected')\n")
    with pytest.raises(CaseFailed, match=r"^1 GPU-marked test\(s\) skipped.*test_b.*nvJPEG"):
        gpu_tests(types.SimpleNamespace(work=tmp_path), tmp_path / "tests")


def test_gpu_tests_state_a_test_that_needs_2_gpus_on_a_machine_with_fewer(
        tmp_path: Path) -> None:
    """As the nccl case: a lent machine has one GPU, and a test skipped because it needs 2
    GPUs is listed as not run there, not a failure (any other skip still fails the case)."""
    from benchmarks.gpu_check import gpu_tests

    if torch.cuda.device_count() >= 2:
        pytest.skip("2 GPUs here: the test would run")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_a():\n    pass\n\n"
        "@pytest.mark.gpu\ndef test_b():\n    pytest.skip('needs 2 GPUs')\n")
    result = gpu_tests(types.SimpleNamespace(work=tmp_path), tmp_path / "tests")
    assert result["tests"] == 2
    [line] = result["not_run (needs 2 GPUs)"]
    assert "test_b" in line


def test_gpu_tests_judge_only_the_gpu_marked_tests(tmp_path: Path) -> None:
    """A module that fails at import (nbformat missing on the GPU image) or skips at import (a
    tracker's extra) holds no GPU test that counts: the GPU-marked tests are collected first,
    and only they are judged (was: collection stopped, or the skip failed the case)."""
    from benchmarks.gpu_check import gpu_tests

    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_a():\n    pass\n\n"
        "@pytest.mark.gpu\n@pytest.mark.parametrize('n', [1, 2])\ndef test_b(n):\n    pass\n\n"
        "def test_not_gpu():\n    pytest.skip('not selected')\n")
    (tests / "test_notebook.py").write_text(
        "import nbformat_not_on_this_image\n\ndef test_n():\n    pass\n")
    (tests / "test_trackers.py").write_text(
        "import pytest\npytest.importorskip('a_tracker_not_installed')\n\n"
        "@pytest.mark.gpu\ndef test_t():\n    pass\n")
    assert gpu_tests(types.SimpleNamespace(work=tmp_path), tests)["tests"] == 3


def test_gpu_tests_fail_when_a_module_with_gpu_tests_cannot_be_imported(tmp_path: Path) -> None:
    from benchmarks.gpu_check import CaseFailed, gpu_tests

    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_a():\n"
                                     "    pass\n")
    (tests / "test_broken.py").write_text("import pytest\nimport not_a_module_here\n\n"
                                          "@pytest.mark.gpu\ndef test_b():\n    pass\n")
    with pytest.raises(CaseFailed, match=r"^module\(s\) with GPU-marked tests fail to import: "
                                         r"\S*tests/test_broken\.py\n"):
        gpu_tests(types.SimpleNamespace(work=tmp_path), tests)


def test_on_a_gpu_a_case_not_run_is_a_failure() -> None:
    from benchmarks.gpu_check import CASES, _status

    assert _status({"ok": None}, cuda=True) == "FAIL (not run)"
    assert _status({"ok": None, "not_run": "deadline"}, cuda=False) == "FAIL (not run: deadline)"
    assert _status({"ok": None}, cuda=False) == "skipped"  # --device cpu: CUDA-only cases
    assert "gpu_tests" in CASES and "unit_tests_on_cuda" not in CASES


def test_the_plan_fits_a_lent_machine_and_prints_each_device_call() -> None:
    """--plan on the CPU: every case in one batch, each batch <= 8 minutes on one H100, all of
    them <= 14, and each batch's device call with the Hydra wheels carried."""
    from benchmarks.gpu_check import BATCHES, CASES, EXPECTED_S, plan

    result = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True,
                            env=offline_env(PYTHON=sys.executable), timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    found = plan()
    assert found["fits"] and found["total_s"] <= 14 * 60
    assert sorted(n for b in BATCHES for n in b) == sorted(CASES) == sorted(EXPECTED_S)
    for batch in found["batches"]:
        assert batch["expected_s"] <= 8 * 60
        assert any(line.startswith(f"batch {batch['batch']}: expected {batch['expected_s']} s ")
                   for line in lines)
        call = (f"  device call: run(command='bash benchmarks/gpu_check.sh --batch "
                f"{batch['batch']} \"$OUT\"', carry=[\".whl\"], timeout_s=570)")
        assert call in lines
        for name, seconds in batch["cases"].items():
            assert any(line.split()[:3] == [name, str(seconds), "s"] for line in lines), name
    assert lines[-1].startswith(f"total: expected {found['total_s']} s")
    assert "; fits;" in lines[-1]


def _fake_cases(monkeypatch: pytest.MonkeyPatch, cases: dict) -> None:
    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_check, "CASES", {n: (c, True) for n, c in cases.items()})
    monkeypatch.setattr(gpu_check, "Context", lambda work, device, deadline: types.SimpleNamespace(
        work=work, device=device, deadline=deadline, cuda=device == "cuda"))


def test_the_json_is_written_after_every_case(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A call cut off at its limit still brings back the cases that ran."""
    from benchmarks import gpu_check

    report = tmp_path / "gpu_check.json"

    def second(ctx: object) -> dict:
        return {"seen": json.loads(report.read_text())["status"]}  # written when first ended

    _fake_cases(monkeypatch, {"first": lambda ctx: {"x": 1}, "second": second})
    result = gpu_check.main([str(tmp_path), "--device", "cpu", "--only", "first,second",
                             "--parallel", "1"])
    assert result["cases"]["second"]["seen"] == {"first": "PASS"}
    assert json.loads(report.read_text())["passed"] == ["first", "second"]


def test_no_case_starts_after_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import gpu_check

    _fake_cases(monkeypatch, {"late": lambda ctx: {"x": 1}})
    with pytest.raises(SystemExit) as caught:
        gpu_check.main([str(tmp_path), "--device", "cpu", "--only", "late", "--deadline", "0"])
    assert caught.value.code == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"] == {"late": "FAIL (not run: deadline)"}


def test_nccl_on_one_gpu_is_not_run_and_leaves_the_verdict_to_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import gpu_check

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    result = gpu_check._timed_case(gpu_check.nccl, types.SimpleNamespace(cuda=True))
    assert result["ok"] is None and result["not_run"] == "needs 2 GPUs"
    assert gpu_check._status(result, cuda=True) == "NOT RUN (needs 2 GPUs)"
    summary = gpu_check.summarise({"nccl": result, "bf16": {"ok": True}}, "cuda", 1.0)
    assert summary["failed"] == [] and summary["not_run"] == ["nccl"]
    assert summary["passed"] == ["bf16"]


@pytest.mark.parametrize(("device", "precision", "summary", "problem"), [
    ("NVIDIA H100 80GB HBM3", "bf16-mixed",
     {"peak_tflops": 989.5, "peak_source": "datasheet: H100 SXM bf16", "tflops": 300.0}, None),
    ("NVIDIA L40", "16-mixed",  # the sparse figure: MFU would read half
     {"peak_tflops": 362.0, "peak_source": "datasheet: L40 fp16", "tflops": 90.0},
     "not the datasheet's 181.05 (L40 fp16)"),
    ("NVIDIA H200", "16-mixed",  # a bf16 peak for an fp16 run
     {"peak_tflops": 989.5, "peak_source": "datasheet: H200 SXM bf16", "tflops": 90.0},
     "not the datasheet's 989.5 (H200 SXM fp16)"),
    ("Some Future GPU", "bf16-mixed",
     {"peak_tflops": 500.0, "peak_source": "measured: bf16 matmul on cuda", "tflops": 90.0}, None),
    ("Some Future GPU", "bf16-mixed",
     {"peak_tflops": 50.0, "peak_source": "measured: bf16 matmul on cuda", "tflops": 90.0},
     "unlisted: not a measured peak"),
])
def test_the_amp_cases_check_the_peak_against_the_table(device: str, precision: str,
                                                        summary: dict, problem: str | None
                                                        ) -> None:
    """(was: only 0 < mfu < 1, which a 2x peak passes)"""
    from benchmarks.gpu_check import peak_problem

    found = peak_problem(summary, device, precision)
    assert found is None if problem is None else problem in found, found
