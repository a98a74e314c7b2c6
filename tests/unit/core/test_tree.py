"""The one walker over nested batches and states: types kept, containers shared or copied."""

from __future__ import annotations

import collections
import dataclasses

import torch

from trainkit.core.tree import tensors, tree_leaves, tree_map

Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    images: torch.Tensor
    ids: list[str]


def _nested() -> dict:
    return {"pair": Pair(torch.ones(2), [torch.zeros(1), "tag"]),
            "batch": Batch(torch.full((2,), 3.0), ["a", "b"]),
            "ordered": collections.OrderedDict(w=torch.ones(1)),
            "counts": collections.defaultdict(int, n=torch.tensor(4)),
            "step": 7}


def test_every_tensor_is_mapped_and_every_container_keeps_its_type() -> None:
    out = tree_map(lambda t: t + 1, _nested())
    assert isinstance(out["pair"], Pair) and out["pair"].x.tolist() == [2.0, 2.0]
    assert out["pair"].y[0].tolist() == [1.0] and out["pair"].y[1] == "tag"
    assert isinstance(out["batch"], Batch) and out["batch"].images.tolist() == [4.0, 4.0]
    assert out["batch"].ids == ["a", "b"]
    assert type(out["ordered"]) is collections.OrderedDict
    assert out["counts"]["n"].item() == 5  # a defaultdict comes back as a plain dict
    assert out["step"] == 7


def test_unchanged_containers_are_shared_and_changed_ones_rebuilt() -> None:
    tree = _nested()
    same = tree_map(lambda t: t, tree)
    assert same is tree  # a batch already on its device: no allocation at all
    assert same["pair"] is tree["pair"] and same["pair"].y is tree["pair"].y
    changed = tree_map(lambda t: t.clone(), tree)
    assert changed is not tree and changed["pair"].y is not tree["pair"].y
    assert changed["pair"].y[1] is tree["pair"].y[1]  # leaves other than tensors kept as they are


def test_without_sharing_every_container_is_a_copy() -> None:
    tree = {"a": [torch.ones(1)], "b": {"c": torch.zeros(1)}}
    copy = tree_map(lambda t: t, tree, share=False)
    assert copy is not tree and copy["a"] is not tree["a"] and copy["b"] is not tree["b"]
    tree["a"].append(torch.ones(1))
    assert len(copy["a"]) == 1  # a snapshot does not change with the original


def test_paths_name_each_tensor_and_leaves_come_in_the_walk_order() -> None:
    seen = []
    tree_map(lambda t, path: seen.append(path) or t, _nested(), with_path=True)
    assert seen == ["pair[0]", "pair[1][0]", "batch.images", "ordered.w", "counts.n"]
    paths = [path for path, _ in tree_leaves(_nested())]
    assert paths == ["pair[0]", "pair[1][0]", "pair[1][1]", "batch.images", "batch.ids[0]",
                     "batch.ids[1]", "ordered.w", "counts.n", "step"]
    assert [t.tolist() for t in tensors(_nested())] == [[1.0, 1.0], [0.0], [3.0, 3.0], [1.0], 4]
