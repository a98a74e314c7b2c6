"""Top-1 accuracy for evaluation, without torchmetrics' import cost.

``import torchmetrics`` imports torchvision and, through it, ``torch._dynamo``: about 2 s of a
run that only counts correct predictions. :class:`Accuracy` does that with two counters on the
device; it has the metric interface :func:`trainkit.loop.evaluation.evaluate` uses (``reset``,
``update``, ``compute``, ``to``), as torchmetrics' metrics do, and sums over ranks the same way.
"""

from __future__ import annotations

import torch

from trainkit.distributed import group


class Accuracy:
    """The fraction of samples whose largest logit is the target's (micro-averaged top-1).

    Equals ``torchmetrics.classification.MulticlassAccuracy(n, average="micro")``. Counts stay
    on the device until :meth:`compute` (no host sync per batch); under a process group,
    ``compute`` sums them over all ranks.

    Args:
        num_classes: when given, a batch of logits with another number of columns is refused.
        device: where the counters live (:meth:`to` moves them).

    Example:
        >>> acc = Accuracy()
        >>> acc.update(torch.tensor([[2.0, 1.0], [0.0, 3.0]]), torch.tensor([0, 0]))
        >>> float(acc.compute())
        0.5
    """

    def __init__(self, num_classes: int | None = None, device: torch.device | str = "cpu") -> None:
        self.num_classes = num_classes  # when given, logits must have this many columns
        self.device = torch.device(device)
        self.reset()

    def to(self, device: torch.device | str) -> Accuracy:
        """Keep the counters on ``device`` (that of the logits); returns ``self``."""
        self.device = torch.device(device)
        self._correct = self._correct.to(self.device)
        return self

    def reset(self) -> None:
        """Start counting again."""
        self._correct = torch.zeros((), dtype=torch.int64, device=self.device)
        self._count = 0

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Count a batch: ``logits`` ``[N, classes]``, ``targets`` ``[N]`` class indices."""
        if (logits.dim() != 2 or targets.shape != logits.shape[:1]
                or self.num_classes not in (None, logits.shape[1])):
            classes = self.num_classes or "classes"
            raise ValueError(f"expected logits [N, {classes}] and targets [N], got "
                             f"{list(logits.shape)} and {list(targets.shape)}")
        self._correct += (logits.argmax(dim=1) == targets).sum()
        self._count += targets.shape[0]

    def compute(self) -> torch.Tensor:
        """Correct / counted, over all ranks (0 when nothing was counted)."""
        correct, count = group.sum_across_ranks(self._correct, self._count)
        return torch.tensor(correct / count if count else 0.0)
