"""Count the collectives a piece of code issues, with their payload sizes and, given the mesh's group
names, the mesh dimension each ran on.

torch's CommDebugMode does the counting but its module tracker fails on diffusers' FluxTransformer2DModel
(IndexError in `_fw_set_module_hook`, torch 2.13), and it does not say which process group a collective
used, so this is the same dispatch-level idea without module tracking, plus byte counts and groups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# collective op (c10d in-place ops and the _c10d_functional ops DTensor uses) -> (kind, payload argument)
_PAYLOAD = {
    "all_reduce": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", 0),  # input: scaled by the world size below
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
    "allreduce_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),  # output buffer: the gathered size
    "allgather_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 0),
    "alltoall_": ("all_to_all", 0),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
}


def all_gather_single(output: torch.Tensor, local: torch.Tensor, group: Any = None) -> None:
    """Every rank's `local` into `output`, rank-major along dim 0 (the same size on every rank).

    torch >= 2.12 names it `dist.all_gather_single` and deprecates `all_gather_into_tensor` (FutureWarning);
    torch 2.9-2.11, which ROCm users and the project's GPU machines run, have only the latter.
    """
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def _bytes(arg: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(arg) if isinstance(t, torch.Tensor))


@dataclass
class CollectiveLog:
    counts: Counter[str] = field(default_factory=Counter)  # kind -> collectives
    payload_bytes: Counter[str] = field(default_factory=Counter)  # kind -> bytes
    # (mesh dimension, kind) -> collectives / bytes; the dimension is "other" for a group the mesh lacks
    dimension_counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    dimension_payload: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def wire_bytes_per_rank(self, world_size: int) -> float:
        """Bytes each rank sends with ring algorithms: all-reduce 2(N-1)/N, gathers/scatters (N-1)/N."""
        n = world_size
        factors = {
            "all_reduce": 2 * (n - 1) / n,
            "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n,
        }
        return sum(self.payload_bytes[k] * factors.get(k, 1.0) for k in self.payload_bytes)


def _group_name(namespace: str, args: tuple[Any, ...]) -> str | None:
    """The process group a collective runs on: functional collectives name it (a str argument); c10d ops
    carry the ProcessGroup as a script object."""
    import torch.distributed as dist

    if namespace == "_c10d_functional":
        return next((a for a in args if isinstance(a, str)), None)
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except RuntimeError:  # a ReduceOp, not a ProcessGroup
                continue
    return None


class CountCollectives(TorchDispatchMode):
    """`with CountCollectives() as log: ...` then `log.log.counts['all_reduce']`.

    `dimensions`: process group name -> mesh dimension (`mesh.ParallelGroups.dimension_names`); then
    `log.log.dimension_counts[("tp", "all_reduce")]` too.
    """

    def __init__(self, dimensions: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.log = CollectiveLog()
        self.dimensions = dict(dimensions or {})

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        namespace = getattr(func, "namespace", "")
        name = func._overloadpacket.__name__
        if namespace in ("c10d", "_c10d_functional") and name in _PAYLOAD:
            kind, index = _PAYLOAD[name]
            payload = _bytes(args[index]) if len(args) > index else 0
            if namespace == "_c10d_functional" and kind == "all_gather":
                payload *= int(args[1])  # functional all-gather: input shard x group size
            self.log.counts[kind] += 1
            self.log.payload_bytes[kind] += payload
            dim = self.dimensions.get(_group_name(namespace, args) or "", "other")
            self.log.dimension_counts[(dim, kind)] += 1
            self.log.dimension_payload[(dim, kind)] += payload
            return _waited(namespace, func(*args, **(kwargs or {})))
        return func(*args, **(kwargs or {}))


def _waited(namespace: str, out: Any) -> Any:
    """Wait for a functional collective at once.

    Code run only to be measured or probed (meta tensors, the fake group, the LSE probe's K/V) may never
    use a collective's result, and torch then keeps its work registered and warns at exit about
    "unwaited collective calls".
    """
    if namespace == "_c10d_functional":
        torch.ops._c10d_functional.wait_tensor(out)
    return out


class WaitCollectives(TorchDispatchMode):
    """`with WaitCollectives(): ...` waits for every functional collective as soon as it is issued."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ != "wait_tensor":
            return _waited(getattr(func, "namespace", ""), out)
        return out


def collectives_need_host(backend: str, device: torch.device) -> bool:
    """Whether diffusers' context-parallel all-gathers on `device` must go through host memory over `backend`.

    torch 2.11's functional all-gather over gloo crashes on CUDA tensors (SIGSEGV in `wait_tensor`; seen on
    an H100 with torch 2.11.0+cu130, two workers sharing the GPU) while c10d's own all-gather and the
    functional all-to-all work (each probed alone there). diffusers' ring attention gathers K/V and its
    output hook gathers the result with the functional one, so ring and Ulysses over gloo on GPUs (two
    workers on one GPU; a machine without NCCL/RCCL) crashed their workers.
    """
    return backend == "gloo" and device.type not in ("cpu", "meta")


class HostGatherFuncol:
    """torch's functional collectives module as diffusers' context-parallel code sees it, with
    `all_gather_tensor` run on a host copy and its result moved back to the tensor's device.

    gloo moves device tensors through host memory anyway, so the bytes moved are the same. A module
    stand-in rather than a dispatch mode around the forward: torch.compile leaves a frame uncompiled while a
    dispatch mode is active, and these collectives run in the eager parts the compiled blocks leave. `routed`
    counts the gathers it moved (tests)."""

    def __init__(self, funcol: Any) -> None:
        self.funcol = funcol
        self.routed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.funcol, name)

    def all_gather_tensor(
        self, tensor: torch.Tensor, gather_dim: int, group: Any, *args: Any, **kwargs: Any
    ) -> Any:
        self.routed += 1
        gathered = self.funcol.all_gather_tensor(tensor.cpu(), gather_dim, group, *args, **kwargs)
        return gathered.to(tensor.device)  # waits for the collective (an AsyncCollectiveTensor) first


# diffusers' modules that gather with `funcol.all_gather_tensor` (0.36 to 0.42 import it under that name)
DIFFUSERS_GATHERING_MODULES = ("diffusers.hooks.context_parallel", "diffusers.models.attention_dispatch")


def route_diffusers_gathers_through_host() -> HostGatherFuncol:
    """Make diffusers' context-parallel code gather through host memory in this process from now on
    (`collectives_need_host`: a worker whose group is gloo on a GPU) and return the stand-in. Idempotent."""
    import importlib

    modules = [importlib.import_module(name) for name in DIFFUSERS_GATHERING_MODULES]
    for module in modules:
        if isinstance(module.funcol, HostGatherFuncol):
            return module.funcol
    stand_in = HostGatherFuncol(modules[0].funcol)
    for module in modules:
        module.funcol = stand_in
    return stand_in
