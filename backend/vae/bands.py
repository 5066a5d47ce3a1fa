"""Patch parallelism for a VAE: the image split into horizontal bands, one per rank, computed exactly.

Each rank runs the unmodified diffusers VAE on its band of rows under `BandParallel`, a torch function mode
that sees every torch call the model makes and changes the few that mix rows (no module of the VAE is
replaced, so one mechanism covers every VAE built from torch's convolutions, norms and attention):

* `conv2d` / `conv3d`: each band gets the rows its kernel reads beyond its edges from its neighbours (the
  halo: `padding` rows of the kernel's own receptive field, per layer), zeros at the image's edges; a
  `pad` along the rows (diffusers' Downsample2D, Wan's causal Conv3d and ZeroPad2d) is taken over by the
  convolution it feeds, the rows it would add inside the image coming from the neighbours;
* `group_norm`: the statistics of the whole image, not of the band: each rank's count, sum and sum of
  squares per (batch, group), summed over the ranks (float64), then torch's own arithmetic
  (`x * a + b`, a = rstd * weight, b = bias - mean * a);
* `scaled_dot_product_attention` (the mid block's attention over all tokens): every rank's keys and values
  gathered, so the band's queries attend to the whole image;
* `interpolate`: nearest (-exact) by an integer factor is local to a band; any other mode is refused.

Bands follow the latent's rows: rank r holds latent rows `Bands.starts[r]:starts[r+1]` and, at every layer,
the same rows scaled by the layer's resolution (x 2 after each upsampling), so a stride-2 convolution and a
x2 upsampling never split a row pair across ranks and the ranks' band heights need not be equal. A call
that would mix rows another way (a transposed convolution, pooling, a pad not followed by a convolution) is
refused by name, never computed wrong.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..config import ConfigError
from ..plan.vae import band_rows


@dataclass(frozen=True)
class Bands:
    """Latent rows per rank: rank r holds rows `starts[r]` up to `starts[r + 1]` (heights may differ)."""

    starts: tuple[int, ...]

    @classmethod
    def even(cls, rows: int, ranks: int) -> Bands:
        """`rows` latent rows over `ranks` as evenly as possible (the first ranks one row fewer when they do
        not divide: 13 rows over 4 ranks are 3, 3, 3, 4). ConfigError when a rank would get none."""
        band_rows(rows, ranks)  # the planner's refusal of a split with an empty band, one message for both
        return cls(tuple(rows * r // ranks for r in range(ranks + 1)))

    @property
    def ranks(self) -> int:
        return len(self.starts) - 1

    @property
    def rows(self) -> int:
        return self.starts[-1]

    def band(self, rank: int) -> tuple[int, int]:
        return self.starts[rank], self.starts[rank + 1]

    def height(self, rank: int) -> int:
        return self.starts[rank + 1] - self.starts[rank]

    def take(self, x: torch.Tensor, rank: int, scale: int = 1) -> torch.Tensor:
        """Rank `rank`'s rows of `x` (dim -2), `x` having `scale` rows per latent row."""
        start, end = self.band(rank)
        return x[..., start * scale : end * scale, :]


def _tuple(value: Any, n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list | tuple) else (int(value),) * n


def _bind(names: Sequence[tuple[str, Any]], args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """A torch function's arguments by position, defaults filled in (`names`: (name, default) in order)."""
    values = list(args) + [kwargs.get(name, default) for name, default in names[len(args) :]]
    return values


_CONV = (("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0), ("dilation", 1),
         ("groups", 1))  # fmt: skip
_PAD = (("input", None), ("pad", None), ("mode", "constant"), ("value", None))
_NORM = (("input", None), ("num_groups", None), ("weight", None), ("bias", None), ("eps", 1e-5))
_ATTENTION = (("query", None), ("key", None), ("value", None), ("attn_mask", None), ("dropout_p", 0.0),
              ("is_causal", False), ("scale", None), ("enable_gqa", False))  # fmt: skip
_INTERPOLATE = (("input", None), ("size", None), ("scale_factor", None), ("mode", "nearest"))

# Calls that mix rows in ways the bands do not compute: refused by name rather than computed wrong.
_REFUSED: dict[Callable[..., Any], str] = {
    F.conv_transpose2d: "a transposed convolution",
    F.conv_transpose3d: "a transposed convolution",
    F.avg_pool2d: "pooling",
    F.avg_pool3d: "pooling",
    F.max_pool2d: "pooling",
    F.max_pool3d: "pooling",
    F.adaptive_avg_pool2d: "adaptive pooling",
    F.adaptive_avg_pool3d: "adaptive pooling",
    F.unfold: "unfold",
    F.fold: "fold",
    F.grid_sample: "grid sampling",
}


class BandParallel(TorchFunctionMode):
    """Run a VAE's forward on this rank's band of rows (module docstring): `with BandParallel(bands):`.

    `group`: the process group of the ranks sharing the image (the world when None); rank r of it holds
    band r of `bands`.
    """

    def __init__(self, bands: Bands, group: Any = None) -> None:
        super().__init__()
        self.bands, self.group = bands, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world != bands.ranks:
            raise ValueError(f"{bands.ranks} bands for a group of {self.world} ranks")
        # A pad along the rows waiting for the convolution it feeds: (the padded tensor, top, bottom).
        # (the padded tensor, rows above, rows below, columns each side, zero frames before)
        self._pending: tuple[weakref.ref[torch.Tensor], int, int, int, int] | None = None

    # ------------------------------------------------------------------ dispatch

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (F.conv2d, F.conv3d):
            return self._conv(func, *_bind(_CONV, args, kwargs))
        if self._pending is not None and func in _HANDLED:  # a pad must feed the next convolution
            self._refuse_pending(func)
        if func is F.pad:
            return self._pad(*_bind(_PAD, args, kwargs))
        if func is F.group_norm:
            return self._group_norm(*_bind(_NORM, args, kwargs))
        if func is F.scaled_dot_product_attention:
            return self._attention(func, *_bind(_ATTENTION, args, kwargs))
        if func is F.interpolate:
            self._check_interpolate(*_bind(_INTERPOLATE, args, kwargs))
        elif func in _REFUSED:
            raise NotImplementedError(
                f"{getattr(func, '__name__', func)} ({_REFUSED[func]}) mixes rows across the bands of a "
                "patch-parallel VAE; this VAE cannot be split into bands"
            )
        return func(*args, **kwargs)

    def __exit__(self, *exc: Any) -> None:
        pending, self._pending = self._pending, None
        super().__exit__(*exc)
        if pending is not None and exc[0] is None:
            raise NotImplementedError("a pad along the rows was not followed by a convolution")

    def _refuse_pending(self, func: Any) -> None:
        self._pending = None
        raise NotImplementedError(
            f"a pad along the rows fed {getattr(func, '__name__', func)} before any convolution; only a "
            "convolution can take the rows a band's pad adds inside the image"
        )

    # ------------------------------------------------------------------ halo

    def _halo(
        self, x: torch.Tensor, above: int, below: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The `above` rows over this band (the previous rank's last ones) and the `below` rows under it (the
        next rank's first ones); None at the image's top or bottom edge. Every rank sends the same amounts,
        so one all-gather of each rank's first `below` and last `above` rows serves all of them."""
        if self.world == 1 or above + below == 0:
            return None, None
        rows = x.shape[-2]
        if rows < max(above, below):
            raise ConfigError(
                f"a band of {rows} row(s) is thinner than the {max(above, below)} row(s) a convolution reads "
                "beyond it; use fewer ranks for this image, or a taller image"
            )
        mine = torch.cat([x.narrow(-2, 0, below), x.narrow(-2, rows - above, above)], dim=-2).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        top = parts[self.rank - 1].narrow(-2, below, above) if self.rank > 0 else None
        bottom = parts[self.rank + 1].narrow(-2, 0, below) if self.rank < self.world - 1 else None
        return top, bottom

    # ------------------------------------------------------------------ convolution

    def _conv(
        self,
        func: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: Any,
        padding: Any,
        dilation: Any,
        groups: int,
    ) -> torch.Tensor:
        n = weight.ndim - 2
        if isinstance(padding, str):
            if padding != "valid":
                raise NotImplementedError(f"padding={padding!r} in a patch-parallel VAE (use numbers)")
            padding = 0
        stride, padding, dilation = _tuple(stride, n), list(_tuple(padding, n)), _tuple(dilation, n)
        top = bottom = padding[-2]
        pending, self._pending = self._pending, None
        if pending is not None:
            if pending[0]() is not x:
                self._pending = pending
                self._refuse_pending(func)
            _, above, below, width, front = pending
            top, bottom, padding[-1] = top + above, bottom + below, padding[-1] + width
            if front:
                x, weight = _causal_frames(x, weight, front, stride, dilation)
        reach = dilation[-2] * (weight.shape[-2] - 1) + 1  # rows one output row reads
        step = stride[-2]
        padding[-2] = 0
        rows = x.shape[-2]
        if rows % step:
            raise ConfigError(f"a band of {rows} rows does not divide by the convolution's stride {step}")
        if reach == 1 and top == bottom == 0:  # a 1x1 convolution: each row on its own
            return func(x, weight, bias, stride, tuple(padding), dilation, groups)
        # Rows the next rank needs from this one's top (the rest of the kernel past the band's last row)
        below = max(0, reach - step - top)
        above_rows, below_rows = self._halo(x, top, below)
        same = step == 1 and top == bottom and reach == 2 * top + 1
        if same and rows >= 2 * top:
            return self._conv_fixing_edges(func, x, weight, bias, stride, padding, dilation, groups, top,
                                           above_rows, below_rows)  # fmt: skip
        last = self.rank == self.world - 1
        parts = [_zeros_or(above_rows, x, top), x, _zeros_or(below_rows, x, bottom if last else below)]
        out = func(torch.cat(parts, dim=-2), weight, bias, stride, tuple(padding), dilation, groups)
        if not last and out.shape[-2] != rows // step:
            raise NotImplementedError(
                f"a convolution (kernel {weight.shape[-2]} rows, stride {step}, pad {top}/{bottom}) gives "
                f"{out.shape[-2]} rows for a band of {rows}: it does not keep bands aligned"
            )
        return out

    def _conv_fixing_edges(
        self,
        func: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: Any,
        padding: list[int],
        dilation: Any,
        groups: int,
        halo: int,
        above: torch.Tensor | None,
        below: torch.Tensor | None,
    ) -> torch.Tensor:
        """A same-size convolution of the band as if zeros lay beyond it, then its first and last `halo`
        output rows again from the neighbours' rows: no copy of the whole band (the memory a decode has at
        its widest layer is what the split is for)."""
        rows = x.shape[-2]
        zero_padded = list(padding)
        zero_padded[-2] = halo
        out = func(x, weight, bias, stride, tuple(zero_padded), dilation, groups)
        if above is not None:
            edge = torch.cat([above, x.narrow(-2, 0, 2 * halo)], dim=-2)
            out.narrow(-2, 0, halo).copy_(func(edge, weight, bias, stride, tuple(padding), dilation, groups))
        if below is not None:
            edge = torch.cat([x.narrow(-2, rows - 2 * halo, 2 * halo), below], dim=-2)
            fixed = func(edge, weight, bias, stride, tuple(padding), dilation, groups)
            out.narrow(-2, rows - halo, halo).copy_(fixed)
        return out

    # ------------------------------------------------------------------ pad

    def _pad(self, x: torch.Tensor, pad: Sequence[int], mode: str, value: float | None) -> torch.Tensor:
        """A zero pad of a band is left to the convolution it feeds: along the rows (which inside the image
        come from the neighbours), along the columns when even (the convolution's own padding) and, for one
        frame, the causal zero frames before it (the kernel's taps that would read them are dropped, as
        ComfyUI 0.33's causal Conv3d does): no padded copy of the band is made. Other pads are applied."""
        pad = list(pad)
        if x.ndim < 4 or len(pad) < 4 or pad[2] == pad[3] == 0:
            return F.pad(x, pad, mode, value)
        top, bottom = pad[2], pad[3]
        if mode != "constant" or value not in (None, 0, 0.0) or min(pad) < 0:
            raise NotImplementedError(
                f"a {mode} pad {pad} (value {value}) in a patch-parallel VAE; only zero padding feeding a "
                "convolution is split into bands"
            )
        pad[2] = pad[3] = 0
        width = front = 0
        if pad[0] == pad[1]:
            width, pad[0], pad[1] = pad[0], 0, 0
        if x.ndim == 5 and len(pad) >= 6 and pad[5] == 0 and x.shape[2] == 1:
            front, pad[4] = pad[4], 0
        out = F.pad(x, pad, mode, value) if any(pad) else x.view(x.shape)
        self._pending = (weakref.ref(out), top, bottom, width, front)
        return out

    # ------------------------------------------------------------------ group norm

    def _group_norm(
        self,
        x: torch.Tensor,
        num_groups: int,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """torch's group_norm with the mean and variance of the whole image (every rank's band)."""
        batch, channels = x.shape[:2]
        grouped = x.reshape(batch, num_groups, -1)
        count = grouped.shape[-1]
        mean, var = (m.to(torch.float64) for m in _moments(grouped))
        # [3, B, G]: count, sum, sum of squares over this band, summed over the ranks in float64
        stats = torch.stack([torch.full_like(mean, count), mean * count, (var + mean * mean) * count])
        if self.world > 1:
            dist.all_reduce(stats, group=self.group)
        total, sum_, squares = stats
        mean = sum_ / total
        var = (squares / total - mean * mean).clamp_min(0)
        rstd = torch.rsqrt(var + eps)
        per_channel = channels // num_groups
        a = rstd.repeat_interleave(per_channel, dim=1)  # [B, C]
        if weight is not None:
            a = a * weight.to(torch.float64)
        b = -mean.repeat_interleave(per_channel, dim=1) * a
        if bias is not None:
            b = b + bias.to(torch.float64)
        shape = (batch, channels) + (1,) * (x.ndim - 2)
        dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        a, b = a.to(dtype).view(shape), b.to(dtype).view(shape)
        if x.dtype == dtype:
            return torch.addcmul(b, x, a)
        # A half-precision band is normalised in float32 a few channels at a time into a band of its own dtype,
        # as torch's own group_norm kernel computes it: a float32 copy of the whole band and its float32
        # result would hold 4 more full-resolution maps at the decoder's peak (ComfyUI's own decode holds
        # 5 maps in bfloat16; the band code held 10 with them).
        out = torch.empty_like(x)
        step = max(1, channels // _NORM_SPLITS)
        for part, into, scale, shift in zip(
            x.split(step, 1), out.split(step, 1), a.split(step, 1), b.split(step, 1), strict=True
        ):
            into.copy_(torch.addcmul(shift, part.to(dtype), scale))
        return out

    # ------------------------------------------------------------------ attention

    def _tokens_of(self, tokens: int) -> list[int]:
        """Every rank's tokens at the layer where this rank has `tokens` (bands scale with the latent's)."""
        mine = self.bands.height(self.rank)
        if tokens % mine:
            raise NotImplementedError(
                f"attention over {tokens} tokens on a band of {mine} latent rows: not whole rows of the image"
            )
        return [tokens // mine * self.bands.height(r) for r in range(self.world)]

    def _gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [..., tokens, d] of every rank, concatenated in rank (= image row) order."""
        sizes = self._tokens_of(x.shape[-2])
        longest = max(sizes)
        padded = F.pad(x, (0, 0, 0, longest - x.shape[-2])) if x.shape[-2] < longest else x.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p.narrow(-2, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=-2)

    def _attention(
        self,
        func: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Any,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
    ) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise NotImplementedError("masked or causal attention in a patch-parallel VAE")
        if self.world > 1:
            k, v = self._gather_tokens(k), self._gather_tokens(v)
        extra = {"enable_gqa": True} if enable_gqa else {}
        return func(q, k, v, dropout_p=dropout_p, scale=scale, **extra)

    # ------------------------------------------------------------------ interpolate

    @staticmethod
    def _check_interpolate(x: torch.Tensor, size: Any, scale_factor: Any, mode: str) -> None:
        factor = _tuple(scale_factor, x.ndim - 2)[-2] if scale_factor is not None else None
        if size is not None or mode not in ("nearest", "nearest-exact") or factor != int(factor):
            raise NotImplementedError(
                f"interpolate(mode={mode!r}, size={size}, scale_factor={scale_factor}) in a patch-parallel "
                "VAE: only nearest upsampling by a whole factor keeps the bands apart"
            )

    # ------------------------------------------------------------------ the image

    def gather(self, x: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """The whole image on rank `dst` (None elsewhere) from every rank's band `x` (rows on dim -2)."""
        if self.world == 1:
            return x
        rows = self._tokens_of(x.shape[-2])
        longest = max(rows)
        padded = F.pad(x, (0, 0, 0, longest - x.shape[-2])) if x.shape[-2] < longest else x.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.world)] if self.rank == dst else None
        dist.gather(padded, parts, dst=dst, group=self.group)
        if parts is None:
            return None
        return torch.cat([p.narrow(-2, 0, n) for p, n in zip(parts, rows, strict=True)], dim=-2)


# The calls the mode changes besides convolutions: none may come between a pad and its convolution.
_NORM_SPLITS = 8  # a half-precision band's GroupNorm: channels normalised in float32 at a time, 1/8 of them
_HANDLED = (F.pad, F.group_norm, F.scaled_dot_product_attention, F.interpolate)


def _causal_frames(
    x: torch.Tensor, weight: torch.Tensor, front: int, stride: Sequence[int], dilation: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One frame after `front` zero frames through a temporal kernel: only the taps that read the frame
    count (the others multiply zeros), unless the kernel reaches past the zeros (then they are made)."""
    taps = weight.shape[2]
    if front == taps - 1 and stride[0] == 1 and dilation[0] == 1:
        return x, weight[:, :, taps - 1 :]
    return F.pad(x, (0, 0, 0, 0, front, 0)), weight


def _zeros_or(rows: torch.Tensor | None, like: torch.Tensor, count: int) -> torch.Tensor:
    """`rows`, or `count` zero rows (the image's edge) shaped like `like`'s rows."""
    if rows is not None:
        return rows
    shape = list(like.shape)
    shape[-2] = count
    return like.new_zeros(shape)


def _moments(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, variance) over the last dim in float32 or better; a half-precision band is upcast a few
    groups at a time, never whole."""
    if grouped.dtype in (torch.float32, torch.float64):
        var, mean = torch.var_mean(grouped, dim=-1, correction=0)
        return mean, var
    means, variances = [], []
    for part in grouped.split(max(1, grouped.shape[1] // 8), dim=1):
        var, mean = torch.var_mean(part.float(), dim=-1, correction=0)
        means.append(mean)
        variances.append(var)
    return torch.cat(means, dim=1), torch.cat(variances, dim=1)


__all__ = ["BandParallel", "Bands"]
