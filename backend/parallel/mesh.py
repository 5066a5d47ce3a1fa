"""One device mesh per worker group and layout: `batch x ring x ulysses x tp` as named dimensions.

A layout (config.ParallelLayout) is realised on torch's `DeviceMesh` (as torchtitan's `ParallelDims` does),
so every collective runs on the group of its own dimension and nothing uses the world implicitly:

* tensor parallelism on `mesh["tp"]`'s group (`apply_tensor_parallel(model, groups.tp_group, ...)`, and the
  loader reads each rank's slice by its rank in that group);
* context parallelism on the `mesh["ring", "ulysses"]` sub-mesh, handed to diffusers'
  `ContextParallelConfig(mesh=...)` (context.py checks its shape: diffusers would chunk K/V by the degrees
  and take the ranks from the mesh without comparing them); the LSE guard probes the ring sub-group;
* the batch dimension here: `BatchSplit` gives every group of `tp x ring x ulysses` ranks its share of a
  model call's batch and all-gathers the outputs over `mesh["batch"]`'s group.

Dimension order, outermost to innermost: batch, ring, ulysses, tp. `init_device_mesh` lays ranks out
row-major, so the innermost dimension's groups are neighbouring ranks (0,1 | 2,3): TP, which moves the
most bytes (two all-reduces of every token's hidden state per block), gets the closest GPUs; batch, one
small gather per call, the farthest.

Meshes are built once per worker group and layout (`parallel_groups`): building one creates process
groups, a collective of every rank; a reload in the same layout reuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import MESH_ORDER, ConfigError, ParallelLayout
from .comm import all_gather_single

MESH_DIMS = MESH_ORDER  # outermost to innermost (config.py: the placement rules read it too)
# diffusers flattens the ("ring", "ulysses") sub-mesh into one group for the sequence split and the output
# gather; collectives on it are counted under this name.
CP_DIM = "cp"
GROUPS_ATTR = "_rp_parallel_groups"  # the ParallelGroups a model was parallelised on (`groups_of`)


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """A layout realised on a DeviceMesh: this rank's process group for each dimension."""

    layout: ParallelLayout
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh with MESH_DIMS

    @property
    def tp_group(self) -> Any:
        return self.mesh["tp"].get_group()

    @property
    def cp_mesh(self) -> Any:
        """The ("ring", "ulysses") sub-mesh diffusers' context parallelism runs on."""
        return self.mesh["ring", "ulysses"]

    @property
    def batch_group(self) -> Any:
        return self.mesh["batch"].get_group()

    @property
    def coordinate(self) -> dict[str, int]:
        """This rank's index on every dimension."""
        return dict(zip(MESH_DIMS, self.mesh.get_coordinate(), strict=True))

    def dimension_names(self, cp_group: Any = None) -> dict[str, str]:
        """Process group name -> the dimension(s) it serves ('ring|cp' when one group serves two), for
        counting collectives per dimension (comm.CountCollectives). `cp_group`: diffusers' flattened
        ring x ulysses group (context.cp_group(model)), when context parallelism is applied."""
        names: dict[str, list[str]] = {}
        for dim in MESH_DIMS:
            if self.mesh[dim].size() > 1:
                names.setdefault(self.mesh[dim].get_group().group_name, []).append(dim)
        if cp_group is not None and dist.get_world_size(cp_group) > 1:
            names.setdefault(cp_group.group_name, []).append(CP_DIM)
        return {name: "|".join(dims) for name, dims in names.items()}


_MESHES: dict[tuple[str, tuple[int, ...]], ParallelGroups] = {}
_WORLD: list[Any] = [None]  # the default process group the cached meshes belong to


def parallel_groups(layout: ParallelLayout, device: torch.device) -> ParallelGroups:
    """The mesh of `layout` over the world (its product must be the world size), built on first use.

    Collective the first time for a layout: every rank calls it with the same layout. On the meta device
    (sizing under the fake process group) the mesh is a CPU one.
    """
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("parallel_groups needs an initialised process group (the worker group's)")
    if layout.world_size != dist.get_world_size():
        raise ConfigError(
            f"the layout {layout} needs {layout.world_size} devices but the worker group has "
            f"{dist.get_world_size()}; make the product of its degrees {dist.get_world_size()}"
        )
    if _WORLD[0] is not world:  # a new process group (a test's fake group): its meshes are new too
        _MESHES.clear()
        _WORLD[0] = world
    device_type = "cpu" if device.type == "meta" else device.type
    key = (device_type, layout.shape(MESH_DIMS))
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, key[1], mesh_dim_names=MESH_DIMS)
        _MESHES[key] = ParallelGroups(layout, mesh)
    return _MESHES[key]  # the shape is the layout: the same degrees in MESH_DIMS order


def parallelize(
    model: nn.Module, groups: ParallelGroups, family: Any, *, attention: str | None = None
) -> nn.Module:
    """Apply `groups.layout` to `model` (the same model on every rank) with its `family`'s specs (a
    ModelFamily: `tp`, `cp`, `dims`): tensor parallelism on the tp group unless the loader sharded it
    already, then context parallelism on the ring x ulysses sub-mesh.

    TP first: its readiness check accepts only the families' own attention processors, which CP replaces.
    The batch dimension is not the model's: `BatchSplit` runs around each call.
    """
    from .context import apply_context_parallel
    from .tensor import apply_tensor_parallel

    layout = groups.layout
    dims = family.dims(model.config)
    if layout.tp > 1 and getattr(model, "_rp_tensor_parallel", None) is None:
        apply_tensor_parallel(model, groups.tp_group, family.tp, dims)
    if layout.cp > 1:
        apply_context_parallel(
            model, layout.ring, layout.ulysses, spec=family.cp, dims=dims, mesh=groups.cp_mesh,
            attention=attention,
        )  # fmt: skip
    setattr(model, GROUPS_ATTR, groups)
    return model


def groups_of(model: nn.Module) -> ParallelGroups | None:
    """The ParallelGroups `parallelize` recorded on the model (None: a model parallelised another way)."""
    return getattr(model, GROUPS_ATTR, None)


def batch_sizes(batch: int, degree: int) -> list[int]:
    """Entries of a batch of `batch` each of `degree` groups takes: `tensor_split`'s balanced sizes
    (3 over 2: 2 and 1; 1 over 2: 1 and 0)."""
    return [batch // degree + (1 if g < batch % degree else 0) for g in range(degree)]


class BatchSplit:
    """One model call's batch over the mesh's batch dimension: this rank's group takes entries
    [start, stop), and `gather` gives every rank the whole output.

    Written here because nothing in torch or diffusers splits a model call over groups of a mesh and
    brings the results back (DDP-style data parallelism splits a dataloader, not one call).

    A group whose share is empty (a call with a smaller batch than the degree) does not run the model: its
    tp / ring / ulysses collectives involve only its own ranks, so nobody waits for it; it takes part in
    the gather alone, with nothing. What that costs: its devices idle for the call, and the call takes as
    long as a single group's (batch 2 x tp 2 at batch 1 is a tp 2 forward with two GPUs idle). The
    planner never picks such a layout for the run it plans.

    The gather pads every share to ceil(batch / degree) (collectives want equal pieces) and is small: the
    output latent only, e.g. 1.0 MB for two 1008x1008 FLUX.1 latents in bf16.
    """

    def __init__(self, groups: ParallelGroups | None, batch: int) -> None:
        self.groups, self.batch = groups, batch
        self.degree = groups.layout.batch if groups is not None else 1
        self.sizes = batch_sizes(batch, self.degree)
        index = groups.coordinate["batch"] if self.degree > 1 else 0
        self.start = sum(self.sizes[:index])
        self.stop = self.start + self.sizes[index]

    @property
    def runs(self) -> bool:
        """Whether this rank's group has entries to compute."""
        return self.stop > self.start

    def take(self, t: Any) -> Any:
        """This group's entries of `t` (a tensor whose first dimension is the batch); None and a scalar
        (one value for the whole batch) stay as they are."""
        if t is None or self.degree == 1 or t.ndim == 0:
            return t
        if t.shape[0] != self.batch:
            raise ValueError(
                f"an input of shape {tuple(t.shape)} does not have the call's batch {self.batch}"
            )
        return t[self.start : self.stop]

    def gather(
        self, out: torch.Tensor | None, entry_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The whole output [batch, *entry_shape] on every rank from each group's share (`out` is this
        group's, None when it has none)."""
        if self.degree == 1:
            assert out is not None
            return out
        width = math.ceil(self.batch / self.degree)
        local = out if out is not None else torch.empty((0, *entry_shape), dtype=dtype, device=device)
        if local.shape[0] < width:
            local = torch.cat([local, local.new_zeros((width - local.shape[0], *entry_shape))])
        gathered = local.new_empty((self.degree * width, *entry_shape))
        assert self.groups is not None
        all_gather_single(gathered, local.contiguous(), group=self.groups.batch_group)
        pieces = gathered.chunk(self.degree)
        return torch.cat([p[:n] for p, n in zip(pieces, self.sizes, strict=True)])


__all__ = [
    "CP_DIM",
    "MESH_DIMS",
    "BatchSplit",
    "ParallelGroups",
    "batch_sizes",
    "groups_of",
    "parallel_groups",
    "parallelize",
]
