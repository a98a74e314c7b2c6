"""A key no part of trainkit reads stops the run in one line naming the closest real key, whether
it came as Hydra's ``+key=value`` (which Hydra adds without asking the schema) or without."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from trainkit.core.errors import ConfigError
from trainkit.core.schema import check_known_keys, config_dir
from trainkit.entry.errors import errors_as_one_line


def _compose(*overrides: str) -> DictConfig:
    import trainkit.entry.train  # noqa: F401 - registers the schema the config names

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize(("override", "line"), [
    ("+trainer.max_step=20", "trainer.max_step is not a setting: did you mean trainer.max_steps?"),
    ("+data.batchsize=8", "data.batchsize is not a setting: did you mean data.batch_size?"),
    ("+checkpoint.every_n_step=5",
     "checkpoint.every_n_step is not a setting: did you mean checkpoint.every_n_steps?"),
    ("+trainer.profile.wiat=1",
     "trainer.profile.wiat is not a setting: did you mean trainer.profile.wait?"),
    ("+epochs=3", "epochs is not a setting"),
])
def test_an_added_key_nobody_reads_is_refused_naming_the_closest(override: str,
                                                                  line: str) -> None:
    cfg = _compose("+exp=mnist", override)
    with pytest.raises(ConfigError) as raised:
        check_known_keys(cfg)
    assert str(raised.value).startswith(line), raised.value


def test_without_plus_hydras_refusal_names_the_closest_key(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited, errors_as_one_line():
        _compose("+exp=mnist", "trainer.max_step=20")
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("trainkit: trainer.max_step is not a setting: did you mean "
                           "trainer.max_steps?"), last


@pytest.mark.parametrize("exp", sorted(p.stem for p in (config_dir() / "exp").glob("*.yaml")))
def test_every_experiment_sets_only_keys_trainkit_reads(exp: str, tmp_path: Path) -> None:
    check_known_keys(_compose(f"+exp={exp}", f"data.root={tmp_path}"))
