"""Typed, frozen configuration for the pack, validated in one place.

Every user-facing limit lives here so that bad input fails before any worker process starts, with a
message that names the input, the value, the limit and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .dtypes import WEIGHT_DTYPES, weight_dtype_alias


def weight_dtype_name(weight_dtype: str | None) -> str:
    """The canonical weight dtype name ('default' for None; dtypes.WEIGHT_DTYPES says what each does);
    ConfigError naming the choices otherwise."""
    if weight_dtype is None:
        return "default"
    name = weight_dtype_alias(weight_dtype) if isinstance(weight_dtype, str) else None
    if name not in WEIGHT_DTYPES:
        raise ConfigError(
            f"weight_dtype={weight_dtype!r} is not a weight dtype; use one of {', '.join(WEIGHT_DTYPES)} "
            "(fp8 weights stay resident at 1 byte each and are upcast per layer to the compute dtype)"
        )
    return name


class ConfigError(ValueError):
    """Bad input from a user or a caller; the message says what to change."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _one_of(values: list[int]) -> str:
    """'2, 3 or 4' — the human list of allowed values."""
    words = [str(v) for v in values]
    if not words:
        return "1 (no degree above 1 divides it)"
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


@dataclass(frozen=True)
class FluxDims:
    """The shape facts of a FLUX transformer that parallel layouts depend on."""

    heads: int
    head_dim: int
    double_blocks: int
    single_blocks: int
    guidance: bool
    mlp_ratio: float = 4.0
    text_dim: int = 4096
    pooled_dim: int = 768
    in_channels: int = 64

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def mlp(self) -> int:
        # diffusers computes the single-block MLP width as int(dim * mlp_ratio); FeedForward uses dim * 4.
        return int(self.hidden * self.mlp_ratio)

    @classmethod
    def from_diffusers_config(cls, config: Mapping[str, Any]) -> FluxDims:
        return cls(
            heads=int(config["num_attention_heads"]),
            head_dim=int(config["attention_head_dim"]),
            double_blocks=int(config["num_layers"]),
            single_blocks=int(config["num_single_layers"]),
            guidance=bool(config.get("guidance_embeds", False)),
            # FLUX.1's config has no mlp_ratio (4.0 is built in); FLUX.2's has 3.0.
            mlp_ratio=float(config.get("mlp_ratio", 4.0)),
            text_dim=int(config.get("joint_attention_dim", 4096)),
            pooled_dim=int(config.get("pooled_projection_dim", 768)),
            in_channels=int(config.get("in_channels", 64)),
        )


def validate_tp_degree(degree: int, dims: FluxDims) -> None:
    """Raise ConfigError unless `degree` splits every width tensor parallelism shards.

    Heads are checked first because they are the binding constraint of FLUX (hidden = heads * head_dim
    and every other sharded width is a multiple of hidden); the other widths are checked too so that a
    model with an unusual MLP ratio still fails here, not with a shape error deep in a forward.
    """
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise ConfigError(f"tp_degree={degree!r} must be a positive integer; use 1 for no tensor parallelism")
    if dims.heads % degree:
        valid = [d for d in _divisors(dims.heads) if d > 1]
        raise ConfigError(
            f"tp_degree={degree} does not divide {dims.heads} attention heads; use {_one_of(valid)}"
        )
    for name, width in (("MLP width", dims.mlp), ("hidden width", dims.hidden)):
        if width % degree:
            valid = [d for d in _divisors(dims.heads) if d > 1 and width % d == 0]
            raise ConfigError(f"tp_degree={degree} does not divide the {name} {width}; use {_one_of(valid)}")


def validate_ulysses_degree(degree: int, dims: FluxDims) -> None:
    """Ulysses gives each rank whole attention heads (all-to-all from tokens to heads): they must divide."""
    if dims.heads % degree:
        valid = [d for d in _divisors(dims.heads) if d > 1]
        raise ConfigError(
            f"ulysses_degree={degree} does not divide {dims.heads} attention heads; use {_one_of(valid)}"
        )


# What `ParallelLayout.make` and the API accept (the API resolves "auto" with the planner).
LAYOUT_KINDS = ("tp", "context", "auto")


@dataclass(frozen=True)
class ParallelLayout:
    """How the devices of a group are used: tensor-parallel degree x ring x Ulysses degrees.

    Their product is the number of devices. TP shards the weights; ring and Ulysses (context
    parallelism) shard the token sequence.
    """

    tp: int = 1
    ring: int = 1
    ulysses: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.ring * self.ulysses

    @classmethod
    def make(
        cls, kind: str, devices: int, ring: int | None = None, ulysses: int | None = None
    ) -> ParallelLayout:
        """The layout a user names: 'tp' → every device shards the weights; 'context' → ring x Ulysses =
        devices, where None or 0 fills the rest (both: all ring).

        'auto' is the planner's choice and needs the model and image (`api.make_layout`,
        `ParallelFlux.auto_layout`); the API, the nodes and the benchmarks all build layouts here.
        """
        if kind == "tp":
            return cls(tp=devices)
        if kind == "context":
            return _split_context(ring or 0, ulysses or 0, devices)
        if kind == "auto":
            raise ConfigError(
                "layout='auto' needs the model, image size and device memory; "
                "use ParallelFlux.auto_layout(...) or pass setup=plan.Setup(...)"
            )
        raise ConfigError(f"layout={kind!r} is not known; use one of {', '.join(LAYOUT_KINDS)}")

    def __str__(self) -> str:
        """The short name tables and progress lines print: 'single', 'tp=4', 'ring=2 x ulysses=2'."""
        if self.world_size == 1:
            return "single"
        if self.tp > 1:
            return f"tp={self.tp}"
        parts = [f"ring={self.ring}"] if self.ring > 1 else []
        parts += [f"ulysses={self.ulysses}"] if self.ulysses > 1 else []
        return " x ".join(parts)

    def describe(self) -> str:
        """The long name the loader panel shows: 'tensor parallel tp=4', 'context parallel ring=2 x ulysses=1'."""
        if self.tp > 1 or (self.ring == 1 and self.ulysses == 1):
            return f"tensor parallel tp={self.tp}"
        return f"context parallel ring={self.ring} x ulysses={self.ulysses}"

    def validate(self, dims: FluxDims, devices: int | None = None) -> None:
        for name in ("tp", "ring", "ulysses"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}_degree={value!r} must be a positive integer; use 1 to turn it off")
        if self.tp > 1 and (self.ring > 1 or self.ulysses > 1):
            raise ConfigError(
                f"tp_degree={self.tp} with ring_degree={self.ring} x ulysses_degree={self.ulysses}: "
                "tensor and context parallelism cannot be combined yet; use one of them"
            )
        validate_tp_degree(self.tp, dims)
        validate_ulysses_degree(self.ulysses, dims)
        if devices is not None and self.world_size != devices:
            raise ConfigError(
                f"the layout tp={self.tp} x ring={self.ring} x ulysses={self.ulysses} needs "
                f"{self.world_size} devices but {devices} were given; make the product equal the device count"
            )

    def validate_sequence(self, image_tokens: int) -> None:
        """Context parallelism gives every device a slice of the image tokens: at least one each.

        Any length otherwise works (uneven lengths are padded and the padding masked), and the text may
        be shorter than the degree because every device then still holds a real image token.
        """
        degree = self.ring * self.ulysses
        if image_tokens < degree:
            raise ConfigError(
                f"an image of {image_tokens} tokens is too short for ring={self.ring} x "
                f"ulysses={self.ulysses} = {degree} devices: each needs at least one image token "
                f"(16x16 pixels); use an image of at least {degree} tokens or fewer devices"
            )


def _split_context(ring: int, ulysses: int, devices: int) -> ParallelLayout:
    """Ring x Ulysses degrees with 0 meaning 'fill the rest' (both 0: all ring); product = device count."""
    for name, value in (("ring_degree", ring), ("ulysses_degree", ulysses)):
        if value < 0:
            raise ConfigError(f"{name}={value} must be 0 (auto) or a positive integer")
    if ring == 0 and ulysses == 0:
        ring, ulysses = devices, 1
    elif ring == 0 or ulysses == 0:
        given_name, given = ("ulysses_degree", ulysses) if ring == 0 else ("ring_degree", ring)
        if devices % given:
            options = ", ".join(str(d) for d in range(1, devices + 1) if devices % d == 0)
            raise ConfigError(
                f"{given_name}={given} does not divide the {devices} devices, so the other degree cannot "
                f"fill the rest; use one of {options}"
            )
        rest = devices // given
        ring, ulysses = (rest, ulysses) if ring == 0 else (ring, rest)
    if ring * ulysses != devices:
        raise ConfigError(
            f"ring_degree={ring} x ulysses_degree={ulysses} = {ring * ulysses} but the loader has "
            f"{devices} devices; make the product {devices}, or set one degree to 0 (auto)"
        )
    return ParallelLayout(ring=ring, ulysses=ulysses)
