"""The planner's inputs: one generation job on one machine (`Setup`) and the link between devices (`Link`).

All sizes are bytes; "GB" in text is 1e9 bytes (see backend/text.py for the units everything prints).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import ConfigError, ModelDims
from ..dtypes import (
    COMPUTE_DTYPES,
    GGUF_BLOCKS,
    WEIGHT_DTYPES,
    compute_dtype_named,
    gguf_bytes_per_value,
    stored_dtype,
)
from ..family import families, get_family
from ..text import GB

# The weight dtypes the planner prices ("default" depends on the file: resolved before planning).
# GGUF files: their quantization type (the planner prices its bytes per value; checkpoint.planned_weight_dtype)
PLANNED_WEIGHT_DTYPES = (*(name for name in WEIGHT_DTYPES if name != "default"), *GGUF_BLOCKS)
MARGIN = 0.10  # of device memory kept free: allocator fragmentation, RCCL/NCCL buffers, runtime context


def held_bytes(weight_dtype: str, compute_bytes: int) -> float:
    """Bytes per value of a linear weight held as `weight_dtype` (a planned name): a GGUF type's bytes per
    value (held quantized: Q4_K 0.5625), 1 for fp8, else the compute dtype's."""
    if weight_dtype in GGUF_BLOCKS:
        return gguf_bytes_per_value(weight_dtype)
    fp8 = WEIGHT_DTYPES[weight_dtype]
    return compute_bytes if fp8 is None else fp8.bytes


def planned_dtype(stored: str) -> str:
    """The planner's weight dtype for a linear weight stored as `stored` (a header's spelling: 'Q6_K', 'BF16',
    'F8_E4M3') and loaded with weight_dtype 'default' (checkpoint/info.py `planned_weight_dtype`'s rule): a
    GGUF type stays quantized, fp8 stays fp8, anything else is held in the compute dtype."""
    if stored in GGUF_BLOCKS:
        return stored
    found = stored_dtype(stored)
    return found.short if found is not None and found.fp8 and found.short else "compute"


@dataclass(frozen=True)
class FileWeights:
    """A checkpoint's linear weights tensor by tensor, read from its header (diffusers parameter names):
    `held`, how the loader holds each (a planned name: 'Q6_K' beside 'Q4_K' in a mixed GGUF file, 'fp8_e4m3fn'
    beside 'compute' in an fp8 mixed one), and `blocks`, the quantization block of each tensor stored in a
    GGUF block type (its rows are split only at whole blocks, however it is held). `from_stored` builds it."""

    held: tuple[tuple[str, str], ...]
    blocks: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_stored(cls, stored: Mapping[str, str], weight_dtype: str = "default") -> FileWeights:
        """From each linear weight's stored dtype (the header's spelling) and the loader's `weight_dtype`:
        'default' holds each as stored (`planned_dtype`), 'compute' or an fp8 name converts every one."""
        held = {
            name: planned_dtype(dtype) if weight_dtype == "default" else weight_dtype
            for name, dtype in stored.items()
        }
        blocks = {name: GGUF_BLOCKS[dtype][0] for name, dtype in stored.items() if dtype in GGUF_BLOCKS}
        return cls(tuple(sorted(held.items())), tuple(sorted(blocks.items())))

    @functools.cached_property
    def by_name(self) -> dict[str, str]:
        return dict(self.held)

    @functools.cached_property
    def block_of(self) -> dict[str, int]:
        return dict(self.blocks)


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
# Between hosts: one host's network (its bandwidth shared by the host's devices that send across it at once,
# cost.py `link_for`). A collective over TCP sockets (gloo, NCCL/RCCL's socket transport) pays tens of µs
# more than one inside a host; RDMA (InfiniBand, RoCE) less.
NETWORK_LATENCY_US = 50.0


def network(gbit: float, latency_us: float = NETWORK_LATENCY_US, measured: bool = False) -> Link:
    """A host's network link of `gbit` gigabits per second (as NICs are sold: 10, 25, 100 GbE)."""
    return Link(gbit / 8, latency_us, measured=measured, name=f"{gbit:g} Gb/s between hosts")


def call_batch(images: int, cfg: float = 1.0, together: bool = True) -> int:
    """The batch of one model call for `images` latents: ComfyUI evaluates the negative prompt only when
    cfg is not 1 (comfy/samplers.py `sampling_function`), and then in the same call as the positive when
    the two conds can be concatenated (`together`: the parallel MODEL makes ComfyUI do so whenever their
    text shapes allow it; nodes/comfy_model.py)."""
    return images * (2 if cfg != 1.0 and together else 1)


@dataclass(frozen=True)
class Setup:
    """One generation job on one machine: what the planner needs to price a layout.

    `batch` is the batch of one model call (`call_batch`: images x 2 for cond + uncond at cfg != 1): what
    the batch dimension of a layout splits.
    """

    dims: ModelDims
    width: int = 1024
    height: int = 1024
    batch: int = 1
    # ComfyUI pads FLUX.1's T5 to 256 tokens (longer prompts use more; diffusers: 512) and FLUX.2's text to
    # 512 (the family's `text.tokens`, which ParallelModel.auto_layout passes)
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
    # a registered model family (backend/family.py): which transformer the dims describe (None: the first
    # registered family)
    family: str | None = None
    # image tokens of reference latents (ReferenceLatent): every step carries them after the image's own,
    # so they are split, attended and held like image tokens
    reference_tokens: int = 0
    frames: int = 1  # a video's frames (1: an image), for a family whose model takes several
    # a checkpoint's own linear weights, tensor by tensor (`plan --checkpoint`, the loader's auto): priced and
    # split as the file holds each one; None prices every linear weight as `weight_dtype`
    file_weights: FileWeights | None = None
    # several hosts (docs/hosts.md): `devices` split evenly over `hosts`, placed host by host; collectives of a
    # mesh dimension that spans hosts travel over `inter_host` (None: 10 Gb/s Ethernet), TP never does
    hosts: int = 1
    inter_host: Link | None = None

    @property
    def host_devices(self) -> int:
        """Devices on one host."""
        return self.devices // self.hosts

    @property
    def between_hosts(self) -> Link:
        return self.inter_host if self.inter_host is not None else network(10.0)

    def __post_init__(self) -> None:
        known = [f.name for f in families()]
        if self.family is None:
            object.__setattr__(self, "family", known[0])
        if self.family not in known:
            raise ConfigError(
                f"family={self.family!r} is not a model family the planner knows; use {', '.join(known)}"
            )
        if self.dtype not in (d.name for d in COMPUTE_DTYPES):
            raise ConfigError(
                f"dtype={self.dtype!r} is not supported; use {', '.join(d.name for d in COMPUTE_DTYPES)}"
            )
        held = set(self.file_weights.by_name.values()) if self.file_weights is not None else set()
        for name in sorted({self.weight_dtype, *held}):
            if name not in PLANNED_WEIGHT_DTYPES:
                raise ConfigError(
                    f"weight_dtype={name!r} is not supported by the planner; use "
                    f"{', '.join(PLANNED_WEIGHT_DTYPES)} (resolve 'default' from the checkpoint first)"
                )
        rows, cols = self.token_pixels
        if self.width % cols or self.height % rows or self.width < cols or self.height < rows:
            side = f"{rows}" if rows == cols else f"{cols}x{rows}"
            raise ConfigError(
                f"image size {self.width}x{self.height} is not a multiple of {side} pixels; use e.g. 1024x1024"
            )
        family = get_family(self.family)
        step = family.latent.temporal_downscale * family.geometry.patch[0]
        if not isinstance(self.frames, int) or self.frames < 1 or (self.frames - 1) % step:
            raise ConfigError(
                f"frames={self.frames!r} must be 1 + a multiple of {step} for {family.title} (e.g. {1 + 20 * step})"
            )
        if self.frames > 1 and not family.geometry.frames:
            raise ConfigError(f"frames={self.frames}: {family.title} makes images, not videos; use frames=1")
        if not isinstance(self.hosts, int) or self.hosts < 1 or self.devices % self.hosts:
            raise ConfigError(
                f"hosts={self.hosts!r} must be a positive integer that divides devices={self.devices} (the planner "
                "prices hosts with as many devices each)"
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
        return compute_dtype_named(self.dtype).bytes

    @property
    def linear_bytes(self) -> float:
        """Bytes per resident linear-weight element: 1 for fp8, a GGUF type's bytes per value (held quantized:
        Q4_K 0.5625), else the compute dtype's."""
        return held_bytes(self.weight_dtype, self.bytes)

    def linear_bytes_of(self) -> dict[str, float]:
        """Bytes per value of each linear weight the checkpoint names (`file_weights`); empty without one."""
        if self.file_weights is None:
            return {}
        return {name: held_bytes(held, self.bytes) for name, held in self.file_weights.held}

    def quantized_blocks(self, parameters: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
        """The quantization block of each linear weight stored in GGUF blocks, by parameter name: the file's
        (`file_weights`), or, for a GGUF type priced for every weight, each 2-D one whose rows are whole
        blocks (a GGUF writer keeps the others in F16: the narrow embedders). `parameters`: name -> shape."""
        if self.file_weights is not None:
            return self.file_weights.block_of
        if self.weight_dtype not in GGUF_BLOCKS:
            return {}
        block = GGUF_BLOCKS[self.weight_dtype][0]
        return {n: block for n, shape in parameters.items() if len(shape) == 2 and shape[-1] % block == 0}

    @property
    def token_pixels(self) -> tuple[int, int]:
        """Pixels per image token along (height, width): the family's patch x its VAE's scale (16 for FLUX.1,
        FLUX.2 and Qwen-Image alike)."""
        return get_family(self.family).token_pixels()

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """One entry of the latent this image makes, as [1, C, T, H, W] (T: latent frames)."""
        fmt = get_family(self.family).latent
        scale = fmt.downscale
        return (1, fmt.channels, fmt.latent_frames(self.frames), self.height // scale, self.width // scale)

    @property
    def latent_tokens(self) -> int:
        """The image's own tokens (a call's output: reference latents' tokens are dropped)."""
        return get_family(self.family).tokens(self.latent_shape)

    @property
    def image_tokens(self) -> int:
        """The image's tokens plus the references'."""
        return self.latent_tokens + self.reference_tokens

    @property
    def joint_text(self) -> bool:
        """Whether the text joins the image tokens in one self-attention (and is split with them)."""
        return get_family(self.family).text.joint

    @property
    def tokens(self) -> int:
        """The tokens a block's self-attention runs over: the image's, with the text's when it joins them."""
        return self.image_tokens + (self.text_tokens if self.joint_text else 0)

    @property
    def usable_bytes(self) -> float:
        return self.memory_gb * GB * (1 - self.margin)
