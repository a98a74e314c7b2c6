"""Token-normalised loss under real torchrun (2 ranks, gloo, DDP): 2 ranks x 16 padded texts
give the gradient of one process's batch of 32 (the count summed across the ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist.test_torchrun import torchrun
from tests.dist.token_loss_window import batches, texts, tiny_lm, window_gradient
from trainkit.models.hf import hf_forward

pytestmark = [pytest.mark.dist]
pytest.importorskip("transformers")


def test_two_ranks_of_16_padded_texts_give_the_gradient_of_one_batch_of_32(
        tmp_path: Path) -> None:
    proc = torchrun(str(tmp_path), module="tests.dist.token_loss_window", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two_ranks = torch.load(tmp_path / "grads.pt")
    whole = window_gradient(tiny_lm(), batches(texts(), 32))
    assert two_ranks.keys() == whole.keys() and whole
    for name in whole:
        torch.testing.assert_close(two_ranks[name], whole[name], rtol=1e-4, atol=1e-6, msg=name)
    # each rank's own mean, averaged by DDP (the rule without the count), is another gradient
    halves = [window_gradient(tiny_lm(), batches(texts()[r * 16:(r + 1) * 16], 16),
                              forward=lambda m, b: hf_forward(m, b)) for r in (0, 1)]
    gaps = [((halves[0][n] + halves[1][n]) / 2 - whole[n]).norm() / whole[n].norm()
            for n in whole]
    assert max(gaps).item() > 0.05
