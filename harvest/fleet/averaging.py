"""The arithmetic of the fleet's collectives, over a torch.distributed gloo group.

Host (CPU, fp32) copies of the LoRA tensors travel, whatever the trainer's device, so the
decode process's GPU gets no communicator of the trainer's. :func:`weighted_average`
(periodic rounds) weights each member by the tokens it trained since the last round (a
round where nobody trained takes the plain mean); :class:`OuterNesterov` (DiLoCo's outer
optimizer) takes the mean's change as an outer gradient for Nesterov momentum;
:func:`sum_gradients` (every_step) weights gradients by label tokens, so the sum is the
whole step's gradient as one process computes it.
"""

from __future__ import annotations

import torch


def flatten(tensors) -> torch.Tensor:
    """One fp32 host vector of ``tensors`` (detached)."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors) -> None:
    """Copy ``flat`` (from :func:`flatten` of the same tensors) back into them, in place."""
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.copy_(flat[offset: offset + count].view_as(tensor).to(tensor.device, tensor.dtype))
        offset += count


def all_reduce_sum(group, tensor: torch.Tensor, timeout_s: float) -> torch.Tensor:
    import datetime

    import torch.distributed as dist

    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    options.timeout = datetime.timedelta(seconds=timeout_s)
    group.allreduce([tensor], options).wait()
    return tensor


def weighted_average(group, size: int, flat: torch.Tensor, tokens: int, timeout_s: float,
                     fresh: bool = False) -> tuple[torch.Tensor, int]:
    """(the round's token-weighted mean of ``flat``, the round's total tokens). A ``fresh``
    member (new to the fleet: its weights are not the fleet's) weighs nothing; a round
    where nobody trained takes the plain mean of the others (of all, if all are fresh)."""
    if fresh:
        tokens = 0
    counts = all_reduce_sum(group, torch.tensor([float(tokens), 0.0 if fresh else 1.0], dtype=torch.float64),
                            timeout_s)
    total, veterans = int(counts[0].item()), int(counts[1].item())
    if total > 0:
        scale = tokens / total
    elif veterans > 0:
        scale = 0.0 if fresh else 1.0 / veterans
    else:
        scale = 1.0 / size
    return all_reduce_sum(group, flat * scale, timeout_s), total


class OuterNesterov:
    """DiLoCo's outer step: Δ = θ_prev − mean (the outer gradient), m ← μ·m + Δ,
    θ ← θ_prev − lr·(Δ + μ·m). θ_prev and m are the fleet's, kept equal on every member
    by averaging them in the round (a member that joined late adopts them)."""

    def __init__(self, lr: float, momentum: float):
        self.lr = lr
        self.momentum = momentum
        self.anchor: torch.Tensor | None = None  # θ_prev: the fleet's weights after the last round
        self.velocity: torch.Tensor | None = None

    def step(self, group, size: int, mean: torch.Tensor, snapshot: torch.Tensor, fresh: bool,
             timeout_s: float) -> torch.Tensor:
        anchor = self.anchor if self.anchor is not None else snapshot
        velocity = self.velocity if self.velocity is not None else torch.zeros_like(mean)
        # A member new to the fleet brings nothing of the fleet's outer state: it weighs 0.
        weight = torch.tensor([0.0 if fresh else 1.0], dtype=torch.float64)
        veterans = int(all_reduce_sum(group, weight, timeout_s).item())
        if veterans == 0:  # the fleet's first round: nothing to step from
            self.anchor, self.velocity = mean.clone(), torch.zeros_like(mean)
            return mean
        share = 0.0 if fresh else 1.0 / veterans
        state = all_reduce_sum(group, torch.cat([anchor, velocity]) * share, timeout_s)
        anchor, velocity = state[: mean.numel()], state[mean.numel():]
        delta = anchor - mean
        velocity = self.momentum * velocity + delta
        weights = anchor - self.lr * (delta + self.momentum * velocity)
        self.anchor, self.velocity = weights.clone(), velocity
        return weights


def sum_gradients(group, params, label_tokens: int, loss: float, timeout_s: float) -> tuple[float, int]:
    """every_step: replace each parameter's gradient (of this member's loss, normalised by
    its own ``label_tokens``) by the whole step's: Σ N_i·g_i / Σ N_i. Returns the step's
    loss and label tokens over every member."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    packed = torch.cat([torch.tensor([float(label_tokens), loss * label_tokens], dtype=torch.float32),
                        flatten(grads) * label_tokens])
    all_reduce_sum(group, packed, timeout_s)
    total = float(packed[0])
    scale = 1.0 / total if total > 0 else 0.0
    for param, grad in zip(params, grads):
        param.grad = grad  # a parameter untouched by this member's micro-batches gets one now
    unflatten_into(packed[2:] * scale, [p.grad for p in params])
    return float(packed[1]) * scale, int(total)
