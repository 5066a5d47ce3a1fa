"""Cancel inside a model call: every rank leaves the same call at the same transformer block.

A cancel (ComfyUI's Cancel, Ctrl+C, `timeout=`, `WorkerGroup.cancel()`) touches a flag file the workers
look for (watch.py `Job.cancel`). Between steps `WorkerContext.step_done` reads it; inside one model call —
one step of a 16384 px image takes minutes — the ranks read it at agreed points: a forward pre-hook on the
model's repeated blocks (the classes the caller names: diffusion/serve.py passes the ones
`_repeated_blocks` names, the same ones compile.py compiles), every `every` blocks. Each rank reads its flag
and the ranks all-reduce it (MAX) over the whole group, so all of them decide alike and raise `JobCancelled` at the same block: none is left in a collective its peers will
never enter. Every rank runs the same blocks in the same order (tensor and context parallelism split each
block's work; under a batch degree each batch group runs the whole model on its entries), so the checks
line up; the batch groups meet at each check instead of only at the call's final gather.
Nothing in a family's forward changes; the hooks are installed once per model and armed only around
the family's model calls in `serve.forward` (`cancellable`).

GPUs: reading a flag computed on the device would wait for every kernel queued before it (the host could
never run ahead). The flag is all-reduced on the device and copied to pinned memory with an event, and
check k acts on check k - `GPU_LAG`'s result (its event long passed): the same decision on every rank, two
checks later. CPUs (gloo) all-reduce synchronously and act at once.

The flag's collective is control traffic, not the model's: it runs outside any dispatch mode
(parallel/comm.py `CountCollectives` does not count it). Under `compile='inductor'` / 'aot_eager' the hook
is excluded from the compiled region (`torch.compiler.disable`), so it is one break before each block's
graph, not a recompile; a call with a batch group that has no entries (a batch degree larger than the
call's batch) is not armed: that group runs no block, and stops with the others at the step's end.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .worker import JobCancelled, WorkerContext

POINTS = 16  # about this many checks per model call: `every` = blocks // POINTS (at least 1)
GPU_LAG = 2  # on a GPU, check k acts on check k - GPU_LAG's all-reduced flag
HOOKS_ATTR = "_rp_cancel_points"  # the model's installed `_Points`


class _Points:
    """The hooks on one model's repeated blocks and, during a call, that call's checks."""

    def __init__(self, model: nn.Module, block_classes: Collection[str]) -> None:
        names = set(block_classes)
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        self.every = max(1, len(blocks) // POINTS)
        self.armed: _Checks | None = None
        self.slots: list[tuple[torch.Tensor, Any]] = []  # the host copies of a GPU's flags (`_Checks`)
        hook = torch.compiler.disable(self._before_block, recursive=True)
        self.handles = [b.register_forward_pre_hook(hook) for b in blocks]

    def _before_block(self, module: nn.Module, args: Any) -> None:
        if self.armed is not None:
            self.armed.before_block()


class _Checks:
    """One model call's cancel checks on this rank. `lag` > 0: check k acts on check k - lag's flag, read
    through a ring of `lag` + 1 host copies (pinned on a GPU, each with an event) kept by `slots`."""

    def __init__(
        self, ctx: WorkerContext, group: Any, every: int, lag: int, slots: list[tuple[torch.Tensor, Any]]
    ) -> None:
        self.ctx, self.group, self.every, self.lag, self.slots = ctx, group, every, lag, slots
        self.blocks, self.checks = 0, 0
        self.size = dist.get_world_size(group) if group is not None else 1
        device = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
        self.gpu = device.type == "cuda"
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        while len(slots) < lag + 1:  # made once per model (pinned allocations are slow)
            slots.append((torch.zeros(1, dtype=torch.int32, pin_memory=self.gpu), self._event()))

    def _event(self) -> Any:
        return torch.cuda.Event() if self.gpu else None

    def before_block(self) -> None:
        self.blocks += 1
        if (self.blocks - 1) % self.every == 0:
            self.check()

    def check(self) -> None:
        from torch.utils._python_dispatch import _disable_current_modes

        self.checks += 1
        with _disable_current_modes(), torch.inference_mode():
            self.flag.fill_(int(self.ctx.cancel_requested()))
            if self.size > 1:
                dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
            stop = bool(self.flag.item()) if self.lag == 0 else self._lagged()
        if stop:
            raise JobCancelled(f"cancelled inside a model call, before block {self.blocks}")

    def _lagged(self) -> bool:
        """Queue this check's flag for the host; the decision of check k - lag (False before that)."""
        host, event = self.slots[self.checks % (self.lag + 1)]
        host.copy_(self.flag, non_blocking=self.gpu)
        if event is not None:
            event.record()
        if self.checks <= self.lag:
            return False
        host, event = self.slots[(self.checks - self.lag) % (self.lag + 1)]
        if event is not None:
            event.synchronize()  # passed long ago: the kernels of `lag` checks have been queued since
        return bool(host.item())


def cancellable(
    ctx: WorkerContext,
    model: nn.Module,
    model_fn: Callable[..., Any],
    block_classes: Collection[str],
    every_group_runs: bool = True,
) -> Callable[..., Any]:
    """`model_fn` (the family's call into `model`) with its calls armed: on a cancel every rank stops at the
    next agreed block (see the module docstring). `every_group_runs`: False when a batch group has no
    entries in this call (not armed: that group runs no block). `block_classes`: the class names of the
    model's repeated blocks, where the checks are; a model without any is cancelled at the call's end."""
    if not every_group_runs or not block_classes:
        return model_fn
    points = getattr(model, HOOKS_ATTR, None)
    if points is None:
        points = _Points(model, block_classes)
        setattr(model, HOOKS_ATTR, points)
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    lag = GPU_LAG if ctx.device.type == "cuda" else 0

    def armed(*args: Any, **kwargs: Any) -> Any:
        points.armed = _Checks(ctx, group, points.every, lag, points.slots)
        try:
            return model_fn(*args, **kwargs)
        finally:
            points.armed = None

    return armed
