"""The planner's inputs: one generation job on one machine (`Setup`) and the link between devices (`Link`).

All sizes are bytes; "GB" in text is 1e9 bytes (see backend/text.py for the units everything prints).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import COMPUTE_DTYPE_BYTES, WEIGHT_DTYPE_BYTES, ConfigError, FluxDims
from ..text import GB

# The weight dtypes the planner prices ("default" depends on the file: resolved before planning).
PLANNED_WEIGHT_DTYPES = tuple(name for name in WEIGHT_DTYPE_BYTES if name != "default")
MARGIN = 0.10  # of device memory kept free: allocator fragmentation, RCCL/NCCL buffers, runtime context

# Model families the planner prices (diffusers FluxTransformer2DModel / Flux2Transformer2DModel).
FAMILIES = ("flux1", "flux2")


@dataclass(frozen=True)
class Link:
    """The link between devices as the cost model sees it: per-GPU bus bandwidth and per-collective latency.

    Bus bandwidth as nccl-tests defines it: an all-reduce of P bytes on N devices moves 2(N-1)/N x P per
    device, so time = latency + that / bandwidth.
    """

    gbps: float  # GB/s per device
    latency_us: float = 30.0
    measured: bool = False
    name: str = "link"

    def describe(self) -> str:
        return f"{self.name} {self.gbps:.0f} GB/s {'measured' if self.measured else 'assumed'}"


PCIE4 = Link(24.0, 30.0, name="PCIe 4.0 x16")
XGMI = Link(300.0, 10.0, name="xGMI / NVLink")


@dataclass(frozen=True)
class Setup:
    """One generation job on one machine: what the planner needs to price a layout."""

    dims: FluxDims
    width: int = 1024
    height: int = 1024
    batch: int = 1
    # ComfyUI pads FLUX.1's T5 to 256 tokens (longer prompts use more; diffusers: 512) and FLUX.2's text to
    # 512 (the family's `text.tokens`, which ParallelFlux.auto_layout passes)
    text_tokens: int = 256
    dtype: str = "bfloat16"  # the compute dtype (activations, and weights unless weight_dtype is fp8)
    devices: int = 1
    memory_gb: float = 24.0  # per device
    link: Link = PCIE4
    tflops: float = 100.0  # sustained dense bf16 throughput of one device
    margin: float = MARGIN
    device_word: str = "GPU"  # how explanations name one device ("CPU worker" for CPU groups)
    # how linear weights are held: "compute" (the compute dtype) or "fp8_e4m3fn" / "fp8_e5m2" (1 byte);
    # a checkpoint's "default" is resolved by the caller (load.planned_weight_dtype)
    weight_dtype: str = "compute"
    family: str = "flux1"  # one of FAMILIES: which transformer the dims describe
    # image tokens of reference latents (Kontext / FLUX.2 ReferenceLatent): every step carries them after
    # the image's own, so they are split, attended and held like image tokens
    reference_tokens: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(
                f"family={self.family!r} is not a model family the planner knows; use {', '.join(FAMILIES)}"
            )
        if self.dtype not in COMPUTE_DTYPE_BYTES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use {', '.join(COMPUTE_DTYPE_BYTES)}")
        if self.weight_dtype not in PLANNED_WEIGHT_DTYPES:
            raise ConfigError(
                f"weight_dtype={self.weight_dtype!r} is not supported by the planner; use "
                f"{', '.join(PLANNED_WEIGHT_DTYPES)} (resolve 'default' from the checkpoint first)"
            )
        if self.width % 16 or self.height % 16 or self.width < 16 or self.height < 16:
            raise ConfigError(
                f"image size {self.width}x{self.height} is not a multiple of 16 pixels; use e.g. 1024x1024"
            )
        for name in ("batch", "devices", "text_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.reference_tokens, int) or self.reference_tokens < 0:
            raise ConfigError(f"reference_tokens={self.reference_tokens!r} must be 0 or a positive integer")
        if self.memory_gb <= 0 or self.link.gbps <= 0 or self.tflops <= 0:
            raise ConfigError(
                f"memory_gb={self.memory_gb}, link {self.link.gbps} GB/s and tflops={self.tflops} "
                "must all be positive"
            )

    @property
    def bytes(self) -> int:
        return COMPUTE_DTYPE_BYTES[self.dtype]

    @property
    def linear_bytes(self) -> int:
        """Bytes per resident linear-weight element: 1 for fp8, else the compute dtype's."""
        return WEIGHT_DTYPE_BYTES[self.weight_dtype] or self.bytes

    @property
    def image_tokens(self) -> int:
        """The image's tokens (one per 16x16 pixels in FLUX.1 and FLUX.2 alike) plus the references'."""
        return (self.width // 16) * (self.height // 16) + self.reference_tokens

    @property
    def tokens(self) -> int:
        return self.image_tokens + self.text_tokens

    @property
    def usable_bytes(self) -> float:
        return self.memory_gb * GB * (1 - self.margin)
