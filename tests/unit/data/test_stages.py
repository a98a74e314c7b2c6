"""The data pipeline keeps its floor plan (docs/architecture.md, "The path of one batch"):
no import circle in trainkit/data, no ``data.name`` switch outside its sources, no new import
against the stage order, and a batch's path no longer than it is. ``python -m
benchmarks.data_structure`` prints the same figures."""

from __future__ import annotations

from pathlib import Path

from benchmarks import data_structure as plan


def test_no_import_circle_in_data() -> None:
    assert plan.circles(plan.data_graph()) == []


def test_the_measure_finds_a_circle_and_an_import_against_the_order() -> None:
    graph = {"trainkit.data.loader.a": {"trainkit.data.device.b"},
             "trainkit.data.device.b": {"trainkit.data.loader.a"}}
    assert plan.circles(graph) == [["trainkit.data.device.b", "trainkit.data.loader.a"]]
    assert plan.against_order(graph) == ["trainkit.data.loader.a -> trainkit.data.device.b"]


def test_no_stage_imports_a_later_one() -> None:
    # a source describes its splits; the pipeline builds their loaders and device stage
    assert plan.against_order(plan.data_graph()) == []


def test_no_data_name_switch_outside_the_sources() -> None:
    assert plan.name_switches() == []


def test_the_switch_pattern_sees_the_forms_it_replaced(tmp_path: Path) -> None:
    lines = ['if data.name == "tokens":', "shape = IMAGES[data.name]",
             "RESIDENT.get(settings.data.name, 0)", 'if cfg.name != "image_folder":',
             'x = settings.data.name in ("a", "b")']
    assert all(plan.SWITCH.search(line) for line in lines)
    assert not plan.SWITCH.search("source = source_of(data.name)")


def test_a_batch_runs_through_no_more_modules_than_today(tmp_path: Path) -> None:
    image = plan.image_batch_modules(tmp_path / "images")
    (tmp_path / "tokens").mkdir()
    tokens = plan.token_batch_modules(tmp_path / "tokens")
    print(f"\nimage-folder batch: {len(image)} modules {image}\ntoken batch: {len(tokens)} "
          f"modules {tokens}")
    assert "trainkit.data.sources.image_files" in image and len(image) <= 4
    assert "trainkit.data.loader.tokens" in tokens and len(tokens) <= 3


def test_the_step_adds_one_module_and_mixed_precision_its_own(tmp_path: Path) -> None:
    """Source to ``optimizer.step``: the data's modules, then the step's (traced, as the
    measure prints them): 5 in all at fp32, the autocast's module under bf16-mixed."""
    batch = next(iter(plan._image_loader(tmp_path / "images")))
    assert plan.step_modules(batch, "32") == ["trainkit.loop.step"]
    assert plan.step_modules(batch, "bf16-mixed") == ["trainkit.loop.step",
                                                      "trainkit.loop.precision"]


def test_the_data_side_saves_no_position() -> None:
    """The position has one holder, the loop's state: no loader or device stage saves one, and
    the measure sees one that does."""
    import torch

    from trainkit.data import DevicePrefetcher, make_loader

    dataset = torch.utils.data.TensorDataset(torch.zeros(8, 1), torch.zeros(8))
    loader = DevicePrefetcher(make_loader(dataset, 2, shuffle=True, num_workers=0), "cpu")
    assert plan.saved_positions(loader) == []

    class Saving:
        def state_dict(self) -> dict:
            return {"epoch": 1, "batch": 2}

    assert plan.saved_positions(Saving()) == ["Saving"]
