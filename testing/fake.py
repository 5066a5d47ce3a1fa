"""One rank of a larger world in one process: torch's `fake` process group (collectives are no-ops).

Used to size shards on the meta device and to time one rank's compute on one device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Make this process rank `rank` of `world_size` for the duration of the block."""
    # Private torch module, but the documented way to fake a world (torch/testing/_internal/distributed).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _register_meta_collectives()

    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialized in this process; fake_process_group needs none"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _register_meta_collectives() -> None:
    """Give c10d's collectives Meta kernels, so shards on the meta device can issue them under the fake
    group. torch 2.9-2.11 have none for `_allgather_base_` (what `dist.all_gather_into_tensor`, the only
    single-tensor all-gather there, dispatches to): TP's modulation gather failed on meta there. torch's own
    `fake_collectives` registers them on import (a no-op where they exist); private, so optional."""
    try:
        import torch.distributed._tools.fake_collectives  # noqa: F401
    except ImportError:
        pass
