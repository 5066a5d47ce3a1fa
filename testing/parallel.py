"""Tensor and context parallelism for a test's or benchmark's model, its family found by its class.

The engine passes a family's specs down (`ModelFamily.tensor_parallel` / `context_parallel`); tests and
benchmarks that hold a bare diffusers model find the family here, above the engine, as a caller would.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..backend.family import family_of


def apply_tensor_parallel(model: nn.Module, group: Any = None) -> nn.Module:
    return family_of(model).tensor_parallel(model, group)


def apply_context_parallel(
    model: nn.Module,
    ring_degree: int = 1,
    ulysses_degree: int = 1,
    *,
    mesh: Any = None,
    attention: str | None = None,
) -> nn.Module:
    return family_of(model).context_parallel(
        model, ring_degree, ulysses_degree, mesh=mesh, attention=attention
    )


def parallelize(model: nn.Module, groups: Any, *, attention: str | None = None) -> nn.Module:
    from ..backend.parallel.mesh import parallelize as engine_parallelize

    return engine_parallelize(model, groups, family_of(model), attention=attention)


__all__ = ["apply_context_parallel", "apply_tensor_parallel", "parallelize"]
