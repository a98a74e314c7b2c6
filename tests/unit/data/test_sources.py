"""The sources' table: each kind gets its own typed config, the shared fields and its own only."""

from __future__ import annotations

import dataclasses

import pytest

from trainkit.config import DataConfig, SharedDataConfig, TokensConfig
from trainkit.core.errors import ConfigError
from trainkit.data import SOURCES
from trainkit.data.sources import own_config

SHARED = {f.name for f in dataclasses.fields(SharedDataConfig)}


def _fields(kind: type) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)}


def test_every_source_config_holds_the_shared_fields_and_no_other_kinds() -> None:
    assert set(SOURCES) == {"mnist", "cifar10", "image_folder", "tokens", "webdataset",
                            "hf_text", "npy_folder"}
    assert all(name == source.name for name, source in SOURCES.items())
    for name, source in SOURCES.items():
        assert _fields(source.config) >= SHARED, name
    image_folder = _fields(SOURCES["image_folder"].config)
    tokens = _fields(SOURCES["tokens"].config)
    assert "image_size" in image_folder and "seq_len" not in image_folder
    assert tokens == SHARED | {"seq_len", "token_dtype", "mix"}
    assert "shards" in _fields(SOURCES["webdataset"].config)
    assert "shards" not in image_folder | tokens
    # the node users type keeps every key of every source
    assert _fields(DataConfig) == set().union(*(_fields(s.config) for s in SOURCES.values()))


def test_a_source_gets_its_part_of_the_data_node_with_the_values_given() -> None:
    node = DataConfig(name="tokens", root="corpus", batch_size=4, seq_len=16, image_size=64)
    own = own_config(node, TokensConfig)
    assert type(own) is TokensConfig
    assert (own.root, own.batch_size, own.seq_len) == ("corpus", 4, 16)
    assert not hasattr(own, "image_size")
    assert own_config(own, TokensConfig) is own  # a typed config is taken as it is


def test_a_source_config_checks_its_own_fields() -> None:
    with pytest.raises(ConfigError, match=r"data\.seq_len"):
        TokensConfig(seq_len=0)
    with pytest.raises(ConfigError, match=r"data\.batch_size"):
        TokensConfig(batch_size=0)


def test_a_key_the_source_does_not_read_is_refused_in_one_line() -> None:
    import torch

    from trainkit.core.runtime import Runtime
    from trainkit.data import load_data

    node = DataConfig(name="tokens", root="corpus", image_size=64)
    with pytest.raises(ConfigError) as refused:
        load_data(node, Runtime(torch.device("cpu")))
    assert str(refused.value) == ("data.image_size=64 is not read by data=tokens: remove it (it "
                                  "is a key of another kind of data)")
    node = DataConfig(name="image_folder", root="photos", loader="dataloader")
    with pytest.raises(ConfigError, match=r"^data.loader='dataloader' is not read by "
                                          r"data=image_folder"):
        load_data(node, Runtime(torch.device("cpu")))


def test_the_shipped_data_configs_set_only_their_sources_keys() -> None:
    """Each configs/data/*.yaml, composed as the entry point composes it, passes the check."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import trainkit.entry.train  # noqa: F401 - registers the schema train.yaml names
    from trainkit.core.schema import config_dir
    from trainkit.data.sources import refuse_unread

    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        for name in SOURCES:
            node = OmegaConf.to_object(compose("train", [f"data={name}", "data.root=x"]).data)
            refuse_unread(node, SOURCES[name].config, f"data={name}")
