"""A small GPT (nanoGPT's shape) and what a language model's run needs around it.

``GPT`` is the network; :func:`lm_forward` turns a batch of token windows (``{"tokens": [B, T+1]}``)
into next-token logits, targets and the z-loss as a scalar of its own (logged as
``train/z_loss``); :func:`lm_loss` is their cross-entropy; :class:`Perplexity` is an evaluation
metric; :class:`PrintSample` a callback that prints a few sampled tokens after each evaluation.
``+exp=lm`` wires them together; ``examples/char_lm.py`` does the same from Python.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainkit.distributed.group import sum_across_ranks


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT: token and position embeddings, causal blocks, an output layer tied to the input,
    initialised as GPT-2 (zero biases, residual projections scaled by ``1/sqrt(2 * layers)``);
    ``+exp=lm`` decays only its 2-D weights (``optim.decay_norm_and_bias=false``).

    Args:
        vocab_size: tokens the model knows (256 for bytes, 50257 for GPT-2's encoding).
        block: the longest context, in tokens (at least the data's ``seq_len``).
        dim, layers, heads: width, depth and attention heads (``dim`` divisible by ``heads``).
    """

    def __init__(self, vocab_size: int = 256, block: int = 256, dim: int = 128, layers: int = 4,
                 heads: int = 4) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.vocab_size, self.block = vocab_size, block
        self.tokens, self.positions = nn.Embedding(vocab_size, dim), nn.Embedding(block, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.apply(_gpt2_init)
        for block in self.blocks:  # GPT-2's residual projections: 1/sqrt(2 layers) smaller
            for residual in (block.proj, block.mlp[2]):  # (each block adds to the stream twice)
                nn.init.normal_(residual.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, time, vocab_size]`` for token ids ``[batch, time]``."""
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return self.ln(self.blocks(x)) @ self.tokens.weight.T


def _gpt2_init(module: nn.Module) -> None:
    """GPT-2's initial weights: N(0, 0.02) for linear and embedding weights (the output layer
    is tied to the token embedding), zero biases; layer norms keep PyTorch's (1, 0)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def lm_forward(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    """Next-token logits and targets, and the z-loss (PaLM's) as a scalar of its own.

    The z-loss, ``mean(logsumexp(logits)^2)``, is how far the softmax's log-normalizer drifts
    from 0; it is reported (as ``train/z_loss``), not added to the loss.
    """
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    z_loss = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
    return logits, tokens[:, 1:], {"z_loss": z_loss}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch (in nats)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Perplexity:
    """exp(mean next-token loss) over an evaluation, summed over ranks (a torchmetrics-like
    metric: ``torchmetrics.text.Perplexity`` does the same, with a heavier import)."""

    def to(self, device: torch.device) -> Perplexity:
        return self

    def reset(self) -> None:
        self.nll, self.count = 0.0, 0

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        self.nll = self.nll + F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                              reduction="sum")
        self.count += targets.numel()

    def compute(self) -> float:
        nll, count = sum_across_ranks(self.nll, self.count)
        return math.exp(nll / max(count, 1))


@torch.no_grad()
def generate(model: GPT, prompt: list[int], length: int, generator: torch.Generator) -> list[int]:
    """``prompt`` followed by ``length`` token ids sampled from ``model`` (temperature 1)."""
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    ids = torch.tensor([prompt], device=device)
    for _ in range(length):
        probs = model(ids[:, -model.block:])[0, -1].float().softmax(-1).cpu()
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator).to(device)[None]],
                        dim=1)
    model.train(was_training)
    return ids[0].tolist()
