"""One accumulation window of a tiny causal LM on padded text, and its gradient; run by torchrun
as one rank of the 2-rank token-loss test (tests/dist/test_token_loss.py).

The unit tests (tests/unit/loop/test_token_loss.py) import the same model, texts and step, so 1
process x 32, 4 x 8 accumulation and 2 ranks x 16 compare alike. As a script: rank R trains on
texts R*16..R*16+15 under DDP (gloo) in one window and rank 0 writes the gradient to
``<out>/grads.pt``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainkit.data.sources.hf_text import PadBatch
from trainkit.loop.precision import Precision
from trainkit.loop.step import WindowStep
from trainkit.models.hf import hf_forward, model_loss

PAD = 0


def tiny_lm(init: float = 0.02) -> nn.Module:
    """A 1-layer GPT-2 with random weights (the same at every call; ``init``: their standard
    deviation), no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=16, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        initializer_range=init, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def texts(n: int = 32) -> list[dict[str, Any]]:
    """``n`` token texts whose lengths grow from 2 to 48 (short ones first: the micro-batches of a
    window hold very different numbers of real tokens)."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.linspace(2, 48, n).round().long().tolist()
    return [{"input_ids": torch.randint(1, 64, (length,), generator=gen).tolist()}
            for length in lengths]


def batches(samples: Sequence[dict[str, Any]], size: int) -> list[dict[str, torch.Tensor]]:
    """``samples`` in padded batches of ``size`` (each padded to its longest, as hf_text does)."""
    pad = PadBatch(PAD)
    return [pad(list(samples[i:i + size])) for i in range(0, len(samples), size)]


def window_gradient(model: nn.Module, window: Sequence[Any], *,
                    forward: Callable[..., Any] = hf_forward,
                    criterion: Callable[..., Any] = model_loss,
                    step: Callable[..., Any] | None = None) -> dict[str, torch.Tensor]:
    """The gradient the optimizer steps on after one window through the shared step (the
    built-in step, or ``step`` as a step function), by parameter name."""
    from trainkit.loop.step import ContextStep, StepContext

    named = dict(getattr(model, "module", model).named_parameters())
    optimizer = torch.optim.SGD(named.values(), lr=0.0)
    seen: dict[str, torch.Tensor] = {}

    def record(*_: Any) -> None:
        seen.update({name: p.grad.detach().clone() for name, p in named.items()
                     if p.grad is not None})

    optimizer.register_step_pre_hook(record)
    precision, device = Precision("32"), torch.device("cpu")
    if step is None:
        runner: Any = WindowStep(model, optimizer=optimizer, precision=precision,
                                 criterion=criterion, forward=forward, device=device)
    else:
        runner = ContextStep(step, StepContext({"model": model}, {"model": optimizer},
                                               precision=precision, device=device))
    runner(list(window))
    return seen


def main(out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(tiny_lm())
    mine = texts()[rank * 16:(rank + 1) * 16]
    grads = window_gradient(model, batches(mine, 16))
    if rank == 0:
        torch.save(grads, Path(out) / "grads.pt")
    # no rank tears gloo's connections down while the other still reads (an abort, exit -6)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
