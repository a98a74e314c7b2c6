"""The image regularisation keys (data.auto_augment, random_erasing, mixup, cutmix): bad values
and keys a kind of data does not read are refused in one line."""

from __future__ import annotations

import pytest

from trainkit.config import DataConfig, TensorDataConfig
from trainkit.core.errors import ConfigError
from trainkit.data.sources import refuse_unread


@pytest.mark.parametrize(("key", "value", "message"), [
    ("auto_augment", "autoaugment", "data.auto_augment='autoaugment': use 'randaugment' or "),
    ("random_erasing", 1.5, "data.random_erasing is a probability in [0, 1], got 1.5"),
    ("random_erasing", True, "data.random_erasing is a probability"),
    ("mixup", -0.2, "data.mixup is a Beta alpha >= 0 (0: off), got -0.2"),
    ("cutmix", "x", "data.cutmix is a Beta alpha"),
])
def test_bad_values_are_refused(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        DataConfig(name="image_folder", **{key: value})
    assert str(err.value).startswith(message)


def test_gpu_decoding_refuses_worker_augmentation() -> None:
    with pytest.raises(ConfigError, match=r"data\.decode=cpu"):
        DataConfig(name="image_folder", decode="gpu", random_erasing=0.25)


def test_tensor_data_mixes_but_refuses_file_augmentation() -> None:
    refuse_unread(DataConfig(name="cifar10", mixup=0.5, cutmix=1.0), TensorDataConfig, "cifar10")
    with pytest.raises(ConfigError, match=r"data\.auto_augment=.randaugment. is not read by"):
        refuse_unread(DataConfig(name="cifar10", auto_augment="randaugment"), TensorDataConfig,
                      "cifar10")
