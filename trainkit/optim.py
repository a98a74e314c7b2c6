"""AdamW that never imports ``torch._dynamo``: the same update as ``torch.optim.AdamW``.

Every ``torch.optim`` optimizer imports ``torch._dynamo`` on first use: ``add_param_group``
(called by the constructor), ``zero_grad``, ``state_dict`` and ``load_state_dict`` are wrapped by
``torch._disable_dynamo``, and ``step`` by a helper that imports it, so that ``torch.compile``
can trace around them. That import (sympy, the FX symbolic-shapes machinery) costs 1.5-2 s of a
run that never compiles: a quarter of ``+exp=mnist``. This class implements those methods
itself and does the update with ``torch.optim.adamw.adamw``, torch's public functional AdamW
(fused into one kernel on CPU and CUDA by default), so the arithmetic is torch's own and the
state dicts have ``torch.optim.AdamW``'s layout: either loads the other's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (decoupled weight decay, no AMSGrad) without ``torch._dynamo``.

    Args:
        params: parameters, or parameter groups (dicts with ``params`` and any of the options).
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decoupled weight decay coefficient.
        fused: one kernel for all parameters (floating-point parameters on CPU or CUDA);
            ``None``: fused wherever every parameter allows it, else the per-tensor loop.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = AdamW(model.parameters(), lr=1e-3)
        >>> model(torch.ones(1, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, fused: bool | None = None) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, "
                             f"{weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "fused": fused}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its own options override the defaults (as in ``torch.optim``)."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        seen = {id(p) for group in self.param_groups for p in group["params"]}
        if any(id(p) in seen for p in params) or len({id(p) for p in params}) < len(params):
            raise ValueError("a parameter appears in more than one group (or twice in one)")
        if not all(isinstance(p, torch.Tensor) and p.is_leaf for p in params):
            raise TypeError("an optimizer takes leaf tensors (parameters) only")
        group = {**self.defaults, **param_group, "params": params}
        if group["fused"] is None:
            group["fused"] = _fusable(params)
        self.param_groups.append(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (``set_to_none=False``: zero them in place)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One AdamW update of every parameter that has a gradient; returns ``closure()``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p, group["fused"]) for p in params]
            beta1, beta2 = group["betas"]
            adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                  [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                  foreach=False if group["fused"] else None, fused=group["fused"],
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        return loss

    def _state(self, p: torch.Tensor, fused: bool) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:  # as torch.optim.AdamW: a float32 step count, on the device when fused
            device = p.device if fused else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: ...}, "param_groups": [...]}``, as ``torch.optim`` lays it out."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
            groups.append(packed)
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the options and state of a :meth:`state_dict` (or ``torch.optim.AdamW``'s)."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the saved optimizer state has a different number of parameters "
                             "per group than this optimizer")
        for group, new in zip(self.param_groups, saved):
            group.update({k: v for k, v in new.items() if k != "params"})
            group["betas"] = tuple(group["betas"])
            if group.get("fused") is None:
                group["fused"] = self.defaults["fused"] is not False and _fusable(group["params"])
        self.state.clear()
        for group, new in zip(self.param_groups, saved):
            for p, i in zip(group["params"], new["params"]):
                if i in state_dict["state"]:
                    self.state[p] = _placed(state_dict["state"][i], p, group["fused"])


def _fusable(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel takes these: floating point, on CPU or CUDA."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def _placed(state: dict[str, Any], p: torch.Tensor, fused: bool) -> dict[str, Any]:
    """One parameter's saved state, moved to where :meth:`AdamW.step` expects it."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            if key == "step":  # float32, on the device when fused (torch's layout)
                value = value.to(device=p.device if fused else "cpu", dtype=torch.float32)
            else:  # the moments follow their parameter's device and dtype
                value = value.to(device=p.device, dtype=p.dtype)
        out[key] = value
    return out
