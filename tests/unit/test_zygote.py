"""run_module's forked runs (tests/helpers/zygote.py) are what a fresh ``python -m`` is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, offline_env, run_module, start_module
from trainkit.core.signals import PREEMPTION_SIGNALS

PROBE = "tests.helpers.child_probe"


def _seen(done: subprocess.CompletedProcess[str]) -> dict:
    seen = json.loads(done.stdout)
    seen["env"].pop("PYTEST_CURRENT_TEST", None)  # the test's phase, not the process's
    return seen


def test_a_forked_run_sees_what_a_fresh_one_does() -> None:
    forked, fresh = run_module(PROBE, "exit", "3"), run_module(PROBE, "exit", "3", fresh=True)
    assert forked.returncode == fresh.returncode == 3
    assert forked.stderr == fresh.stderr == "to stderr\n"
    a, b = _seen(forked), _seen(fresh)
    assert a["argv"] == b["argv"] == [str(REPO / "tests" / "helpers" / "child_probe.py"),
                                      "exit", "3"]
    assert a["cwd"] == b["cwd"] == str(REPO)
    assert a["spec"] == b["spec"] == PROBE
    assert a["env"] == b["env"]
    assert a["threads"] == b["threads"] == 1
    assert forked.args[-3:] == [PROBE, "exit", "3"]


def test_a_change_to_the_test_processs_environment_leaves_its_runs_forked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sets variables of its own in ``os.environ`` (a compiled kernel's load,
    ``elastic_launch``) and leaves them: the runs after such a change fork from a zygote that
    imported in the new environment (they had started fresh for the rest of the session), and a
    run the old zygote started goes on to its end."""
    sleeping = start_module(PROBE, "sleep", "60")
    before = _seen(run_module(PROBE))["parent"]
    monkeypatch.setenv("TRAINKIT_PROBE", "set by the test process")  # put back after the test
    seen = _seen(run_module(PROBE))
    assert seen["parent"] not in (before, os.getpid())  # a new zygote's child
    assert seen["env"]["TRAINKIT_PROBE"] == "set by the test process"
    assert sleeping.poll() is None
    sleeping.kill()
    assert sleeping.wait(timeout=60) == -signal.SIGKILL


def test_forked_runs_draw_their_own_random_numbers() -> None:
    draws = {_seen(run_module(PROBE))["random"] for _ in range(3)}
    assert len(draws) == 3


def test_an_exception_is_a_traceback_and_status_1() -> None:
    done = run_module(PROBE, "raise")
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "RuntimeError: raised in the child" in done.stderr


def test_a_thread_pool_left_running_ends_with_the_run() -> None:
    """Its workers are told to stop at exit, then joined, as the interpreter does."""
    done = run_module(PROBE, "pool", timeout=120)
    assert done.returncode == 0 and _seen(done)["threads"] > 1


def test_a_timeout_kills_the_run_and_the_next_run_works() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_module(PROBE, "sleep", "60", timeout=1)
    assert run_module(PROBE, "exit", "0").returncode == 0


def test_another_environment_gets_a_fresh_interpreter() -> None:
    done = run_module(PROBE, env=offline_env(TRAINKIT_PROBE="1"))
    assert done.returncode == 0 and _seen(done)["env"]["TRAINKIT_PROBE"] == "1"


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_started_runs_overlap_and_each_reports_its_own_end(fresh: bool) -> None:
    """A forked run's handle answers as the fresh run's ``subprocess.Popen`` does."""
    sleeping = start_module(PROBE, "sleep", "60", fresh=fresh)
    quick = start_module(PROBE, "exit", "4", fresh=fresh)
    assert quick.wait(timeout=60) == 4 and sleeping.poll() is None
    out, err = quick.communicate()
    assert json.loads(out)["argv"][1:] == ["exit", "4"] and err == "to stderr\n"
    sleeping.send_signal(signal.SIGKILL)
    assert sleeping.wait(timeout=60) == -signal.SIGKILL
    sleeping.kill()  # ended: no signal sent
    waited = start_module(PROBE, "sleep", "60", fresh=fresh)
    with pytest.raises(subprocess.TimeoutExpired):
        waited.communicate(timeout=0.1)
    waited.terminate()
    assert waited.wait(timeout=60) == -signal.SIGTERM


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_started_run_appends_to_its_file_hears_preemption_and_may_lead_a_session(
        tmp_path: Path, fresh: bool) -> None:
    out = tmp_path / "run.out"
    out.write_text("before\n")
    run = start_module(PROBE, "exit", "0", out=out, new_session=True, fresh=fresh)
    assert run.wait(timeout=60) == 0
    before, seen, stderr = out.read_text().splitlines()
    assert (before, stderr) == ("before", "to stderr")
    seen = json.loads(seen)
    assert not {s.name for s in PREEMPTION_SIGNALS} & set(seen["ignored"])
    assert seen["leader"]
