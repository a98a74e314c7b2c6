from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from trainkit.config import CheckpointConfig, DataConfig, TrainConfig, TrainerConfig
from trainkit.core.errors import LINE_LIMIT, ConfigError
from trainkit.entry.errors import errors_as_one_line
from trainkit.entry.train import CONFIG_DIR

EXPERIMENTS = sorted(p.stem for p in (Path(CONFIG_DIR) / "exp").glob("*.yaml"))


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_every_experiment_composes_into_typed_settings(exp: str) -> None:
    cfg = _compose(f"+exp={exp}")
    if OmegaConf.is_missing(cfg.data, "root"):  # own data (+exp=folder): the user names it
        cfg = _compose(f"+exp={exp}", "data.root=/data/pets")
    settings = OmegaConf.to_object(cfg)
    assert isinstance(settings, TrainConfig)
    assert isinstance(settings.trainer, TrainerConfig)
    for node in ("model", "optim", "sched"):
        assert "_target_" in cfg[node], f"{exp}: {node} has no _target_"


def test_mnist_experiment_exists() -> None:
    assert "mnist" in EXPERIMENTS


def test_contract_keys_exist() -> None:
    cfg = _compose("+exp=mnist")
    for key in ("trainer.max_epochs", "trainer.max_steps", "trainer.precision",
                "trainer.accumulate_grad_batches", "trainer.gradient_clip_val",
                "trainer.device", "trainer.seed", "trainer.compile",
                "trainer.activation_checkpointing", "trainer.log_every_n_steps",
                "data.root", "data.batch_size", "data.num_workers", "data.pin_memory",
                "data.verify", "checkpoint.every_n_steps", "checkpoint.keep_last",
                "checkpoint.resume"):
        OmegaConf.select(cfg, key, throw_on_missing=True)
        assert key.split(".")[-1] in cfg[key.split(".")[0]], key


def test_data_root_defaults_to_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINKIT_DATA_DIR", "/somewhere/data")
    assert _compose("+exp=mnist").data.root == "/somewhere/data"
    monkeypatch.delenv("TRAINKIT_DATA_DIR")
    assert _compose("+exp=mnist").data.root == "./data"


def test_own_images_need_data_root_whatever_the_env(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    """data=image_folder's `root: ???` stays required: no fall-back to the built-in datasets'
    $TRAINKIT_DATA_DIR (whose MNIST files it then complained about); one line says what to set."""
    monkeypatch.setenv("TRAINKIT_DATA_DIR", "/somewhere/data")
    cfg = _compose("data=image_folder")
    assert OmegaConf.is_missing(cfg.data, "root")
    assert _compose("data=image_folder", "data.root=/data/pets").data.root == "/data/pets"
    with pytest.raises(SystemExit) as stop, errors_as_one_line():
        OmegaConf.to_object(cfg)
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "trainkit: data.root is not set and has no default here: add "
        "data.root=/path/to/your/data to the command")


def test_precision_given_as_number_becomes_text() -> None:
    settings = OmegaConf.to_object(_compose("+exp=mnist", "trainer.precision=32"))
    assert settings.trainer.precision == "32"


def test_wrong_type_fails_while_composing() -> None:
    with pytest.raises(Exception) as info:
        _compose("+exp=mnist", "data.batch_size=abc")
    cause = info.value.__cause__ or info.value
    assert isinstance(cause, ValidationError)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("data.batch_size=-1", "data.batch_size must be >= 1"),
        ("data.batch_size=0", "data.batch_size must be >= 1"),
        ("trainer.precision=fp8", "trainer.precision='fp8' is not one of"),
        ("trainer.accumulate_grad_batches=0", "accumulate_grad_batches must be >= 1"),
        ("trainer.max_steps=-5", "trainer.max_steps must be >= -1"),
        ("trainer.max_epochs=-1", "trainer.max_epochs must be >= 1"),
        ("trainer.gradient_clip_val=-1.0", "gradient_clip_val must be > 0"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last must be >= 1"),
        ("checkpoint.every_n_minutes=-1", "checkpoint.every_n_minutes must be >= 0"),
        ("checkpoint.mode=best", "checkpoint.mode='best'"),
        ("trainer.ema_decay=1.5", "trainer.ema_decay must be in"),
        ("trainer.nonfinite_patience=-1", "trainer.nonfinite_patience must be >= 0"),
        ("data.loader=tape", "data.loader='tape'"),
        ("data.num_workers=-2", "data.num_workers must be >= 0"),
    ],
)
def test_out_of_range_values_fail_with_the_key(override: str, fragment: str) -> None:
    cfg = _compose("+exp=mnist", override)
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")) as caught:
        OmegaConf.to_object(cfg)
    assert len(f"trainkit: {caught.value}") <= LINE_LIMIT and not caught.value.details


def test_configs_are_plain_python_without_hydra() -> None:
    assert TrainerConfig(max_steps=10).max_steps == 10
    assert DataConfig(batch_size=4).batch_size == 4
    assert CheckpointConfig(resume=None).resume is None
    with pytest.raises(ConfigError):
        TrainerConfig(accumulate_grad_batches=True)  # a bool is not a count


def test_library_never_imports_hydra() -> None:
    import subprocess
    import sys

    code = ("import sys, trainkit, trainkit.loop.trainer, trainkit.data, trainkit.env; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("overrides", "policy", "compile_mode"), [
    (["trainer.activation_checkpointing=selective", "trainer.compile=regional"], ["selective"],
     "regional"),
    (["trainer.activation_checkpointing=[selective,Block]", "trainer.compile=true"],
     ["selective", "Block"], True),
    (["trainer.activation_checkpointing=[Block]"], ["Block"], False),
])
def test_checkpointing_policies_and_regional_compile_compose_from_the_command_line(
        overrides: list[str], policy: list[str], compile_mode: object) -> None:
    trainer = OmegaConf.to_object(_compose("+exp=lm", *overrides)).trainer
    assert trainer.activation_checkpointing == policy and trainer.compile == compile_mode
    assert type(trainer.compile) is type(compile_mode)


@pytest.mark.parametrize("size", ["auto", 16])
def test_an_in_batch_loss_refuses_micro_batches_in_one_line(size: object) -> None:
    """k micro-batches of b are not one batch of k*b for a contrastive loss (docs/training.md,
    "In-batch losses"): told so, micro_batch_size does not split the batch, auto included."""
    with pytest.raises(ConfigError) as err:
        TrainerConfig(in_batch_loss=True, micro_batch_size=size)
    line = f"trainkit: {err.value}"
    assert "\n" not in line and len(line) <= LINE_LIMIT
    assert line.startswith(f"trainkit: trainer.micro_batch_size={size} would split batches, "
                           "which changes an in-batch loss (trainer.in_batch_loss=true)")
    assert TrainerConfig(in_batch_loss=True).micro_batch_size is None  # the whole batch: fine
    assert TrainerConfig(micro_batch_size=size).in_batch_loss is False  # off by default
    with pytest.raises(ConfigError, match=r"trainer\.in_batch_loss must be true or false"):
        TrainerConfig(in_batch_loss="yes")
