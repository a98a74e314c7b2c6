"""SLURM's variables read as torchrun's, node lists, job ids and the run dir named after them."""

from __future__ import annotations

import pytest

from trainkit.core.errors import TrainkitError
from trainkit.distributed.slurm import expand_nodelist, export_torch_env, port_for_job
from trainkit.distributed.slurm_requeue import job_id, run_dir_name

SRUN = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
        "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_NODELIST": "gpu[07-08]"}


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a1,b[9-10],c", ["a1", "b9", "b10", "c"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
])
def test_node_lists_expand_as_scontrol_show_hostnames_does(nodelist: str, hosts: list[str]
                                                           ) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[01-03", "node]1[", "node[a-b]", "node[3-1]", ","])
def test_a_node_list_that_does_not_parse_is_one_clear_error(nodelist: str) -> None:
    with pytest.raises(TrainkitError, match=r"cannot read the SLURM node list.*MASTER_ADDR"):
        expand_nodelist(nodelist)


def test_srun_variables_become_torchruns() -> None:
    env = dict(SRUN)
    assert export_torch_env(env)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(port_for_job("4242"))}


def test_torchrun_under_srun_and_your_own_master_are_left_alone() -> None:
    env = {**SRUN, "RANK": "0", "WORLD_SIZE": "8"}  # a torchrun worker inside an srun task
    assert not export_torch_env(env)
    assert env["WORLD_SIZE"] == "8" and "MASTER_ADDR" not in env
    env = {**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}
    export_torch_env(env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("head", "1234")
    assert not export_torch_env({"PATH": "/bin"})  # not under SLURM


def test_job_ids_of_plain_and_array_jobs_name_the_run_dir() -> None:
    assert job_id({}) is None and run_dir_name({}) is None
    assert run_dir_name({"SLURM_JOB_ID": "77"}) == "slurm-77"
    array = {"SLURM_JOB_ID": "80", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}
    assert job_id(array) == "77_3" and run_dir_name(array) == "slurm-77_3"


@pytest.mark.parametrize("env", [
    {"SLURM_JOB_ID": "80", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "x"},
    {"SLURM_JOB_ID": "80", "SLURM_ARRAY_JOB_ID": "77"},
    {"SLURM_JOB_ID": "8 0"},
])
def test_a_malformed_job_id_is_one_clear_error(env: dict[str, str]) -> None:
    with pytest.raises(TrainkitError, match=r"is not a number.*unset SLURM_"):
        job_id(env)
