"""Typed, frozen configuration for the pack, validated in one place.

Every user-facing limit lives here so that bad input fails before any worker process starts, with a
message that names the input, the value, the limit and the fix.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from .dtypes import WEIGHT_DTYPES, weight_dtype_alias
from .echo import echo


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


# The resident model a request names when the caller keeps one model per worker group (a group keeps one per
# slot: `ParallelModel.load(..., slot=...)`, each ComfyUI loader its own).
DEFAULT_SLOT = "default"

PACKAGE = "rocm_parallel"
# This module's name minus '.backend.config': 'rocm_parallel' when imported as a package (pip, the workers,
# the tests); ComfyUI imports a custom-node pack under its folder's absolute path instead
# ('/home/me/ComfyUI/custom_nodes/rocm_parallel.backend.config').
_IMPORTED_AS = __name__.removesuffix(".backend.config")


def package_named(cls: type) -> type:
    """`cls` named by the module it has in the `rocm_parallel` package, whatever name the pack was imported
    under. ComfyUI shows an error as `module.qualname` (execution.py `full_type_name`) in its dialog and
    /history, so a pack loaded from custom_nodes/ would show the user's install path there; this gives the
    name Python gives the class everywhere else ('rocm_parallel.backend.config.ConfigError'). The class
    itself is untouched: `except` / `isinstance` match it as before."""
    if cls.__module__ == _IMPORTED_AS or cls.__module__.startswith(_IMPORTED_AS + "."):
        cls.__module__ = PACKAGE + cls.__module__[len(_IMPORTED_AS) :]
    return cls


@package_named
class ConfigError(ValueError):
    """Bad input from a user or a caller; the message says what to change. Its subclasses (a checkpoint or
    LoRA refused, the admission refusal) are named by the package too (`package_named`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        package_named(cls)


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
class ModelDims:
    """The shape facts of a transformer that layouts, the checks and the planner depend on, for any family.

    - `heads` x `head_dim` = `hidden`: what tensor parallelism and Ulysses split;
    - `mlp`: the feed-forward width tensor parallelism splits too;
    - `text_dim`: the width of the text features a call takes (`context`);
    - `token_channels`: the features of one latent token going in and out (the latent's channels times the
      patch volume: 64 for FLUX.1's 16 channels in 2 x 2 patches), what a gathered output carries.

    A family's `dims(config)` gives its own subclass (its folder's: block counts, a pooled width, ...),
    which only the family reads; everything generic reads these fields.
    """

    heads: int
    head_dim: int
    mlp: int = 0
    text_dim: int = 0
    token_channels: int = 0

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    def blocks_text(self) -> str:
        """The transformer's blocks for tables ('60 blocks'; a family may say more, e.g. '19+38 blocks')."""
        return f"{getattr(self, 'blocks', 0)} blocks"


def validate_tp_degree(degree: int, dims: ModelDims) -> None:
    """Raise ConfigError unless `degree` splits every width tensor parallelism shards.

    Heads are checked first because they are the usual binding constraint (hidden = heads * head_dim); the
    other widths are checked too so that a model with an unusual MLP width still fails here, not with a
    shape error deep in a forward.
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


def validate_ulysses_degree(degree: int, dims: ModelDims, tp: int = 1) -> None:
    """Ulysses gives each rank whole attention heads (all-to-all from tokens to heads): it divides the heads
    a rank holds, all of them, or under tensor parallelism the heads / tp of the rank's shard."""
    local = dims.heads // tp
    if local % degree == 0:
        return
    if tp == 1:
        valid = [d for d in _divisors(dims.heads) if d > 1]
        raise ConfigError(
            f"ulysses_degree={degree} does not divide {dims.heads} attention heads; use {_one_of(valid)}"
        )
    fixes = [f"ulysses_degree {_one_of([d for d in _divisors(local) if d > 1])}"] if local > 1 else []
    tps = [t for t in _divisors(dims.heads) if t != tp and (dims.heads // t) % degree == 0]
    if tps:
        fixes.append(f"tp_degree {_one_of(tps)} with ulysses_degree={degree}")
    fixes.append("ring_degree instead (ring splits no heads)")
    raise ConfigError(
        f"ulysses_degree={degree} does not divide the {local} attention heads a rank holds under "
        f"tp_degree={tp} ({dims.heads} / {tp}); use " + "; or ".join(fixes)
    )


# The degrees of a layout, in the order layouts are written ("batch 2 x tp 2"), and what each splits.
DEGREES = ("batch", "tp", "ring", "ulysses")
# What `ParallelLayout.make` and the API accept besides degrees (the API resolves "auto" with the planner).
LAYOUT_KINDS = ("tp", "context", "auto")
_DEGREE = re.compile(r"^(batch|tp|ring|ulysses)\s*=?\s*([0-9]+)$")
# A degree is a number of devices: past this no machine has them (and int() of 4300 digits raises).
MAX_DEGREE = 4096
# The mesh's dimensions, outermost to innermost (parallel/mesh.py builds it so): consecutive ranks share the
# innermost's groups, so TP's groups are neighbouring ranks, on one host when its degree divides each host's.
MESH_ORDER = ("batch", "ring", "ulysses", "tp")
SYNTAX = "degrees such as 'batch 2 x tp 2' or 'tp2xring2' (batch, tp, ring, ulysses; each at most once)"


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """How the devices of a group are used: batch x tensor-parallel x ring x Ulysses degrees.

    Their product is the number of devices; the devices form one mesh with these named dimensions
    (backend/parallel/mesh.py). `batch` splits every model call's batch (cond and uncond at cfg > 1, or
    several images) over groups of devices; inside a group `tp` shards the weights and `ring` x `ulysses`
    (context parallelism) shard the token sequence.

    Written and read as "batch 2 x tp 2" (`str`, `parse`): what the API, the nodes and the CLI take.
    """

    batch: int = 1
    tp: int = 1
    ring: int = 1
    ulysses: int = 1

    @property
    def world_size(self) -> int:
        return self.batch * self.tp * self.ring * self.ulysses

    @property
    def cp(self) -> int:
        """Context-parallel degree: the ranks one sequence is split over (ring x Ulysses)."""
        return self.ring * self.ulysses

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DEGREES}

    @classmethod
    def make(
        cls,
        kind: str,
        devices: int,
        ring: int | None = None,
        ulysses: int | None = None,
        *,
        batch: int | None = None,
        tp: int | None = None,
    ) -> ParallelLayout:
        """The layout a user names for `devices` devices.

        - 'tp': tensor parallelism over the devices `batch` (default 1) leaves;
        - 'context': ring x Ulysses over the devices `batch` x `tp` leave, None or 0 filling the rest
          (both: all ring);
        - degrees ('batch 2 x tp 2', see `parse`): exactly those.
        A degree that does not apply to `kind` is refused, never ignored (ring=2 with 'tp' would be a
        tp x ring layout the caller did not write down). 'auto' is the planner's choice and needs the
        model and image (`auto.make_layout`, `ParallelModel.auto_layout`).
        """
        if isinstance(kind, str) and kind.strip().lower() in LAYOUT_KINDS:
            kind = kind.strip().lower()
        given = {"ring": ring, "ulysses": ulysses, "batch": batch, "tp": tp}
        applies = {"tp": ("batch",), "context": ("ring", "ulysses", "batch", "tp")}.get(kind, ())
        for name, value in given.items():
            if value and name not in applies:
                raise ConfigError(
                    f"{name}_degree={value} does not apply to layout={kind!r}: " + _where_degrees_go(kind)
                )
        if kind == "tp":
            return cls.filling(devices, "tp", batch=batch or 1)
        if kind == "context":
            return _split_context(ring or 0, ulysses or 0, devices, batch or 1, tp or 1)
        if kind == "auto":
            raise ConfigError(
                "layout='auto' needs the model, image size and device memory; "
                "use ParallelModel.auto_layout(...) or pass setup=plan.Setup(...)"
            )
        return cls.parse(kind)

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """'batch 2 x tp 2', 'batch2xtp2', 'tp=2 x ring=2', 'ulysses 4 x tp 2' (any order; a degree not
        named is 1), or 'single': the layout `str` writes. ConfigError naming the part not understood."""
        if not isinstance(text, str):
            raise ConfigError(
                f"layout={echo(text)} is not a layout; use {', '.join(LAYOUT_KINDS)} or {SYNTAX}"
            )
        words = text.strip().lower()
        if words == "single":
            return cls()
        found: dict[str, int] = {}
        for part in re.split(r"\s*[x\u00d7]\s*", words):
            match = _DEGREE.match(part)
            if match is None:
                raise ConfigError(
                    f"layout={echo(text)} is not a layout: {echo(part)} is not a degree; use "
                    f"{', '.join(LAYOUT_KINDS)} or {SYNTAX}"
                )
            name, digits = match.group(1), match.group(2).lstrip("0") or "0"
            if len(digits) > 9:  # never int() of thousands of digits; a smaller one check_degrees bounds
                raise ConfigError(
                    f"layout={echo(text)}: {name} has a {len(digits)}-digit degree, more than {MAX_DEGREE}; a "
                    f"degree is a number of devices: use {SYNTAX}"
                )
            value = int(digits)
            if name in found:
                raise ConfigError(f"layout={echo(text)} names {name} twice; name each degree once ({SYNTAX})")
            found[name] = value
        layout = cls(**found)
        layout.check_degrees()
        return layout

    @classmethod
    def filling(cls, devices: int, fill: str, fill_name: str | None = None, **fixed: int) -> ParallelLayout:
        """The layout whose `fill` degree takes the devices the `fixed` degrees leave; ConfigError naming
        the degrees when they do not divide the devices (`fill_name`: how the message names `fill`)."""
        layout = cls(**fixed)
        layout.check_degrees()
        taken = layout.world_size
        if devices % taken:
            named = {f"{k}_degree": v for k, v in fixed.items() if v != 1}
            if len(named) == 1:
                ((name, value),) = named.items()
                what, use = f"{name}={value}", f"{name} {_one_of(_divisors(devices))}"
            else:
                what = " x ".join(f"{k}={v}" for k, v in named.items()) + f" = {taken}"
                use = f"degrees whose product divides {devices} ({_one_of(_divisors(devices))})"
            raise ConfigError(
                f"{what} does not divide the {devices} devices, so {fill_name or fill} cannot take the rest; "
                f"use {use}"
            )
        return replace(layout, **{fill: devices // taken})

    def __str__(self) -> str:
        """'batch 2 x tp 2', 'tp 4', 'ring 2 x ulysses 2', 'single': what tables, the panel and `parse` use."""
        parts = [f"{name} {value}" for name, value in self.degrees.items() if value != 1]
        return " x ".join(parts) or "single"

    def describe(self) -> str:
        """The name the loader panel shows: 'batch 2 x tp 2' (the same as `str`)."""
        return str(self)

    def shape(self, order: tuple[str, ...] = DEGREES) -> tuple[int, ...]:
        """The degrees in `order` (the mesh's dimension order, parallel/mesh.py)."""
        return tuple(getattr(self, name) for name in order)

    def check_degrees(self) -> None:
        """Every degree a positive integer."""
        for name, value in self.degrees.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"{name}_degree={echo(value)} must be a positive integer; use 1 to turn it off"
                )
            if value > MAX_DEGREE:
                raise ConfigError(
                    f"{name}_degree={echo(value)} is more than {MAX_DEGREE}; a degree is a number of devices: use "
                    "one that divides yours (e.g. 2), or 1 to turn it off"
                )

    def validate(self, dims: ModelDims, devices: int | None = None) -> None:
        """Raise ConfigError unless this layout works for a model of `dims` on `devices` devices: the
        degrees multiply to the devices, tp divides the widths, Ulysses the heads a rank holds."""
        self.check_degrees()
        if devices is not None:
            self.check_devices(devices, dims)
        validate_tp_degree(self.tp, dims)
        validate_ulysses_degree(self.ulysses, dims, self.tp)

    def check_devices(self, devices: int, dims: ModelDims | None = None) -> None:
        """Raise ConfigError unless the degrees multiply to `devices`. Needs no model (`dims` only narrows the
        suggested fixes to layouts it takes), so a load checks it before reading the checkpoint."""
        if self.world_size != devices:
            raise ConfigError(self._device_count_message(dims, devices))

    def _device_count_message(self, dims: ModelDims | None, devices: int) -> str:
        fixes = []
        for name, value in self.degrees.items():
            others = self.world_size // value
            if value > 1 and devices % others == 0:
                candidate = replace(self, **{name: devices // others})
                try:
                    if dims is None:
                        candidate.check_degrees()
                    else:
                        candidate.validate(dims, devices)
                except ConfigError:
                    continue
                fixes.append(str(candidate))
        hint = f" (e.g. {' or '.join(fixes)})" if fixes else ""
        return (
            f"the layout {self} needs {self.world_size} devices (batch x tp x ring x ulysses) but {devices} "
            f"were given; make the product {devices}{hint}"
        )

    def extent(self, dim: str) -> int:
        """Consecutive ranks one group of mesh dimension `dim` lies within: its degree times those of the
        dimensions inside it ('cp': ring x Ulysses flattened, as diffusers uses it)."""
        inner = MESH_ORDER[MESH_ORDER.index("ring" if dim == "cp" else dim) :]
        return math.prod(getattr(self, name) for name in inner)

    def crosses_hosts(self, dim: str, host_devices: int) -> bool:
        """A group of `dim` spans two hosts of `host_devices` devices each (ranks placed host by host)."""
        return host_devices % self.extent(dim) != 0

    def check_hosts(self, sizes: tuple[int, ...]) -> None:
        """Raise ConfigError unless every tensor-parallel group is inside one host: TP moves the most bytes
        (two all-reduces of every token's hidden state per block), far too many for a network. `sizes`:
        each host's device count in rank order (platforms.host_sizes); ring, Ulysses and batch may span."""
        if len(sizes) < 2 or all(size % self.tp == 0 for size in sizes):
            return
        common = math.gcd(*sizes)
        usable = [d for d in _divisors(common) if self.tp % d == 0 and d > 1]
        counts = " and ".join(str(size) for size in sizes)
        if usable:
            better = replace(self, tp=usable[-1], ring=self.ring * self.tp // usable[-1])
            fix = f"use tp {_one_of(usable)} with ring, Ulysses or batch across the hosts, e.g. '{better}'"
        else:
            fix = "use ring, Ulysses or batch across the hosts (no TP degree divides every host's devices)"
        raise ConfigError(
            f"layout {self} would put a tensor-parallel group of {self.tp} ranks across hosts (the hosts hold "
            f"{counts} devices, placed host by host); TP must stay inside a host: {fix}"
        )

    def validate_sequence(self, image_tokens: int) -> None:
        """Context parallelism gives every device a slice of the image tokens: at least one each.

        Any length otherwise works (uneven lengths are padded and the padding masked), and the text may
        be shorter than the degree because every device then still holds a real image token.
        """
        degree = self.cp
        if image_tokens < degree:
            raise ConfigError(
                f"an image of {image_tokens} tokens is too short for ring={self.ring} x "
                f"ulysses={self.ulysses} = {degree} devices: each needs at least one image token; use an "
                f"image of at least {degree} tokens or fewer devices"
            )


def _where_degrees_go(kind: str) -> str:
    if kind == "tp":
        return (
            "tp takes every device the batch degree leaves; for tensor x context parallelism name every "
            "degree, e.g. layout='tp 2 x ring 2'"
        )
    if kind == "auto":
        return "auto chooses every degree itself; name the degrees instead, e.g. layout='batch 2 x tp 2'"
    return f"layout={kind!r} names its degrees already; write them all there, e.g. 'batch 2 x tp 2'"


def _split_context(ring: int, ulysses: int, devices: int, batch: int = 1, tp: int = 1) -> ParallelLayout:
    """Ring x Ulysses over the devices `batch` x `tp` leave, 0 meaning 'fill the rest' (both 0: all ring)."""
    for name, value in (("ring_degree", ring), ("ulysses_degree", ulysses)):
        if value < 0:
            raise ConfigError(f"{name}={value} must be 0 (auto) or a positive integer")
    outer = ParallelLayout.filling(devices, "ring", "ring x ulysses", batch=batch, tp=tp)
    rest = outer.ring  # the devices left for ring x Ulysses
    where = f"{devices} devices"
    if rest != devices:
        where = f"{rest} devices {replace(outer, ring=1)} leaves of {devices}"
    if ring == 0 and ulysses == 0:
        ring, ulysses = rest, 1
    elif ring == 0 or ulysses == 0:
        given_name, given = ("ulysses_degree", ulysses) if ring == 0 else ("ring_degree", ring)
        if rest % given:
            raise ConfigError(
                f"{given_name}={given} does not divide the {where}, so the other degree cannot fill the rest; "
                f"use one of {', '.join(str(d) for d in _divisors(rest))}"
            )
        ring, ulysses = (rest // given, ulysses) if ring == 0 else (ring, rest // given)
    if ring * ulysses != rest:
        raise ConfigError(
            f"ring_degree={ring} x ulysses_degree={ulysses} = {ring * ulysses} but the loader has {where}; "
            f"make the product {rest}, or set one degree to 0 (auto)"
        )
    return replace(outer, ring=ring, ulysses=ulysses)
