"""What the caller and the workers say about the models a rank keeps resident, whatever they are (a
diffusion model, a text encoder, a VAE): a load's report, a rank's status, an unload (resident/jobs.py
serves the generic methods; each kind's load method answers a `LoadReport`).

| method (module)                          | request               | reply                                   |
|------------------------------------------|-----------------------|-----------------------------------------|
| status, unload (resident/jobs.py)        | -                     | RankStatus, Unloaded (every slot)       |
| unload_slot (resident/jobs.py)           | UnloadRequest         | Unloaded                                |
| load (diffusion/), encoder_load, vae_load | a kind's load request | LoadReport (a RankStatus plus the load) |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import DEFAULT_SLOT
from ..runtime.transport import record


@record
@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory (CPU workers report none)."""

    allocated_gb: float
    peak_gb: float
    free_gb: float
    total_gb: float


@record
@dataclass(frozen=True)
class ResidentModel:
    """One of a rank's resident models: its slot, what it is and its parameter bytes."""

    slot: str
    loaded: Any  # a Loaded, or a test's own record describing random weights
    parameter_bytes: int = 0  # fp8 weights count 1 byte each
    parameter_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    on_host: bool = False  # parked in host memory between jobs (backend/resident/parking.py)


@record
@dataclass(frozen=True)
class RankStatus:
    """One rank's device, resident models and memory. `loaded` and the parameter bytes are the rank's
    whole: the default slot's model (or the only one held), and the bytes of every resident model;
    `models` lists each."""

    rank: int
    device: str
    loaded: Any = None  # a Loaded, a test's own record describing random weights, or None
    parameter_bytes: int = 0  # resident parameter bytes (fp8 weights count 1 byte each)
    parameter_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    memory: DeviceMemory | None = None
    busy: bool = False  # ParallelModel.status() while a job runs: the last report, not a fresh one
    models: tuple[ResidentModel, ...] = ()


@record
@dataclass(frozen=True)
class LoadReport(RankStatus):
    """A rank's status after a load, and what the load did."""

    reused: bool = False  # the model was resident already (only the LoRAs may have changed)
    seconds: float = 0.0  # reading the checkpoint (0 when reused)
    lora_tensors: int = 0  # tensors the LoRA change rewrote
    lora_seconds: float = 0.0


@record
@dataclass(frozen=True)
class UnloadRequest:
    """`unload_slot`: drop the model resident in `slot` (the others stay)."""

    slot: str = DEFAULT_SLOT


@record
@dataclass(frozen=True)
class Unloaded:
    rank: int
    unloaded: bool  # a model was resident
