"""Host placement between a graph's phases: a resident module (a text encoder) whose weights wait in host
memory while another job (sampling, a VAE decode) needs the GPU memory they hold.

The planner (plan/encoder.py `place_encoder`) chooses per machine between keeping the encoder's shard on the
GPUs ("resident") and moving it to pinned host memory while the model samples ("host"). Which one a graph
needs is known for certain only when a job's size is: the sampling activations depend on the image. So the
group decides when a job is admitted, with the same numbers admission uses (admission.py):

* "auto" (the default): the encoder stays on the GPUs; a job whose memory would not fit beside it parks it
  first (each rank moves its own shard to pinned host memory), and the next encode brings it back. The
  planner's "resident" when everything fits, its "host" when the activations need the room.
* "resident": never parked (a job that does not fit beside it is refused, as any job that does not fit).
* "host": parked after every encode (the planner's "host" whatever the job: GPU memory only while encoding).

On CPU workers the host is the device: parking frees nothing, so "auto" never parks there (the state is
still reported, per slot, as `ResidentModel.on_host`). What a module needs to be parked: its request record
names a `park_method` (the worker method that moves it) and builds the message with `placement(on_device)`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..config import ConfigError

PARK_POLICIES = ("auto", "resident", "host")
DEFAULT_POLICY = "auto"


def check_policy(policy: str) -> str:
    """`policy`, or ConfigError naming the choices."""
    if policy not in PARK_POLICIES:
        raise ConfigError(f"placement={policy!r} is not offered; use {', '.join(PARK_POLICIES)}")
    return policy


def parkable(request: Any) -> bool:
    """Whether the resident record `request` can wait in host memory (a text encoder can; a model cannot)."""
    return isinstance(getattr(request, "park_method", None), str)


def to_park(
    residents: Iterable[tuple[str, Any]], parked: set[str], policies: dict[str, str], *, exclude: str = ""
) -> list[str]:
    """The slots a job short of memory may park, least recently used first (`residents` is in that order):
    parkable, on the device now, not "resident" by policy, and not the slot the job itself runs on."""
    return [
        slot
        for slot, request in residents
        if slot != exclude
        and slot not in parked
        and parkable(request)
        and policies.get(slot, DEFAULT_POLICY) != "resident"
    ]


__all__ = ["DEFAULT_POLICY", "PARK_POLICIES", "check_policy", "parkable", "to_park"]
