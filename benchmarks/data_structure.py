"""The data pipeline's floor plan, measured from the code: what docs/architecture.md states.

    python -m benchmarks.data_structure

Each line one figure: the modules a batch runs through (traced), the objects that hold a
position, import circles in ``trainkit/data``, imports against the stage order, and
``data.name`` switches outside ``trainkit/data/sources/``. ``tests/unit/data/test_stages.py``
holds the ones that must not grow.
"""

from __future__ import annotations

import ast
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "trainkit"
# The stage order: each may import the stages before it, never one after. The shared modules
# (the batch types, class names, transforms, remote files) come before every stage.
STAGES = {"shared": 0, "sources": 1, "loader": 2, "device": 3, "pipeline": 4}
SHARED = {"batches", "classes", "transforms", "remote"}
SWITCH = re.compile(r"\b(?:data|cfg)\.name\s*(?:==|!=|\bnot in\b|\bin\b)"
                    r"|\[\s*(?:[\w.]+\.)?data\.name\s*\]|\.get\(\s*(?:[\w.]+\.)?data\.name\b")


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The trainkit modules ``path`` imports, at any depth (a function's imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name in modules}


def data_graph(root: Path = REPO) -> dict[str, set[str]]:
    """``trainkit.data``'s modules, each with the ``trainkit.data`` modules it imports."""
    files = {module_name(p, root): p for p in (root / "trainkit" / "data").rglob("*.py")}
    return {name: imports(path, set(files)) for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def stage(module: str) -> int | None:
    """A ``trainkit.data`` module's place in :data:`STAGES` (None: the package, the tools)."""
    parts = module.split(".")[2:]
    if not parts:
        return None
    if parts[0] in SHARED:
        return STAGES["shared"]
    return STAGES.get(parts[0])


def against_order(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a later stage by an earlier one (``sources -> device``, ...)."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if stage(a) is not None and stage(b) is not None and stage(b) > stage(a))


def name_switches(root: Path = REPO) -> list[str]:
    """Lines outside ``trainkit/data/sources/`` that decide by ``data.name``'s value."""
    sources = root / "trainkit" / "data" / "sources"
    return [f"{p.relative_to(root)}:{i}" for p in sorted((root / "trainkit").rglob("*.py"))
            if sources not in p.parents
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if SWITCH.search(line.split("#")[0])]


def traced_modules(run: Callable[[], Any]) -> list[str]:
    """The trainkit modules whose Python functions run inside ``run()``, in first-call order."""
    seen: dict[str, None] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("trainkit."):
                seen.setdefault(name, None)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return list(seen)


def _second_batch(loader: Any) -> Callable[[], Any]:
    """Start a pass and take its first batch; the returned call takes the next (steady state)."""
    batches: Iterator[Any] = iter(loader)
    next(batches)
    return lambda: next(batches)


def image_batch_modules(folder: Path) -> list[str]:
    """The modules one image-folder training batch runs through, source to device (no workers:
    the workers' code runs in this process)."""
    return traced_modules(_second_batch(_image_loader(folder)))


def _image_loader(folder: Path) -> Any:
    from tests.image_files import make_folder
    from trainkit.config import ImageFolderConfig
    from trainkit.core.runtime import Runtime
    from trainkit.data import load_data

    root = make_folder(folder, per_class=4, val_per_class=1)
    cfg = ImageFolderConfig(name="image_folder", root=str(root), batch_size=4, image_size=16,
                            num_workers=0)
    return load_data(cfg, Runtime.from_env("cpu")).train


def step_modules(batch: Any, precision: str) -> list[str]:
    """The modules the built-in step runs through for ``batch``, up to ``optimizer.step``
    (torch's): a small model's second step (the first builds the optimizer's state)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from trainkit.loop.precision import Precision
    from trainkit.loop.step import WindowStep, default_forward

    images, labels = batch
    model = nn.Sequential(nn.Flatten(), nn.Linear(images[0].numel(), int(labels.max()) + 1))
    step = WindowStep(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      precision=Precision(precision, "cpu"), criterion=F.cross_entropy,
                      forward=default_forward, device=torch.device("cpu"))
    step([batch])
    return traced_modules(lambda: step([batch]))


def token_batch_modules(folder: Path) -> list[str]:
    """The modules one token-window batch runs through, corpus to device."""
    import numpy as np

    from trainkit.config import TokensConfig
    from trainkit.core.runtime import Runtime
    from trainkit.data import load_data

    for split in ("train", "val"):
        np.arange(4096, dtype=np.uint16).tofile(folder / f"{split}.bin")
    cfg = TokensConfig(name="tokens", root=str(folder), batch_size=4, seq_len=16,
                       num_classes=4096)
    loader = load_data(cfg, Runtime.from_env("cpu")).train
    return traced_modules(_second_batch(loader))


def position_holders(loader: Any) -> list[str]:
    """The objects along a loader's chain that keep a data position of their own (an epoch,
    a batch count, a start or a look-ahead), by class name."""
    held, seen, todo = [], set(), [loader]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        own = vars(obj) if hasattr(obj, "__dict__") else {}
        if {"epoch", "batch", "start", "_start", "_ahead"} & set(own):
            held.append(type(obj).__name__)
        todo += [getattr(obj, key, None) for key in ("loader", "sampler", "batch_sampler")]
    return held


def saved_positions(loader: Any) -> list[str]:
    """The objects along a loader's chain whose ``state_dict`` (what a checkpoint keeps of the
    data) holds a position, by class name: the position's holders besides the loop's state."""
    held, obj = [], loader
    while obj is not None:
        state = obj.state_dict() if hasattr(obj, "state_dict") else {}
        if {"epoch", "batch"} & set(state):
            held.append(type(obj).__name__)
        obj = getattr(obj, "loader", None)
    return held


def figures() -> list[str]:
    """One line per figure."""
    graph = data_graph()
    with tempfile.TemporaryDirectory() as tmp:
        image = image_batch_modules(Path(tmp) / "images")
        (Path(tmp) / "tokens").mkdir()
        tokens = token_batch_modules(Path(tmp) / "tokens")
        from tests.image_files import make_folder  # noqa: F401  (made above)
        from trainkit.config import ImageFolderConfig
        from trainkit.core.runtime import Runtime
        from trainkit.data import load_data

        cfg = ImageFolderConfig(name="image_folder", root=str(Path(tmp) / "images"),
                                batch_size=4, image_size=16, num_workers=0)
        train = load_data(cfg, Runtime.from_env("cpu")).train
        holders, saved = position_holders(train), saved_positions(train)
        batch = next(iter(train))
    steps = {mode: step_modules(batch, mode) for mode in ("32", "bf16-mixed")}
    then = "; ".join(f"then at {mode} {len(mods)} ({', '.join(mods)}): {len(image) + len(mods)} "
                     f"to optimizer.step" for mode, mods in steps.items())
    return [
        f"image-folder batch, source to device: {len(image)} modules ({', '.join(image)}); "
        f"{then}",
        f"token batch, corpus to device: {len(tokens)} modules ({', '.join(tokens)}); then "
        f"the same step",
        f"position holders: the loop's TrainState (the fit asks for batches(epoch, start)); "
        f"on the data side {len(saved)} saved {saved or ''}, and {len(holders)} keeping where a "
        f"plain set_epoch + iter pass goes ({', '.join(holders)}), never saved",
        f"import circles in trainkit/data: {len(circles(graph))} {circles(graph) or ''}",
        f"imports against the stage order (shared -> sources -> loader -> device): "
        f"{len(against_order(graph))}",
        f"data.name switches outside trainkit/data/sources/: {len(name_switches())}",
    ]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    for line in figures():
        print(line)
