"""Context parallelism for any family: ring attention, Ulysses, or both, on diffusers' own machinery.

Every rank holds the whole model and 1/N of the tokens. diffusers does the heavy lifting: the model
class's `_cp_plan` (e.g. `FluxTransformer2DModel._cp_plan`) says where to split the sequence (text,
image and their position ids) and where to gather it (`proj_out`), `enable_parallelism(ContextParallelConfig(...))` installs those
hooks and builds the (ring, ulysses) device mesh, and its templated ring / Ulysses / unified attention
moves K/V around and merges the partial results.

Written here, because diffusers cannot do it:

* **Our own attention kernels per device.** diffusers' backends are an Enum-keyed registry with no
  CPU backend that returns the LSE ring attention needs, and no way to add one without replacing a
  registry entry for the whole process. So each attention processor the family names
  (`ContextParallelSpec.processors`) is rebuilt with its
  `dispatch_attention_fn` pointing at `ContextAttention` (the processor's code itself is diffusers'), and
  that calls diffusers' `_templated_context_parallel_attention` with the kernel chosen for the device:
  ROCm flash SDPA (AOTriton), CUDA cuDNN, the CPU flash kernel, or plain math.
* **The LSE guard** (lse.py) wraps the kernel whenever ring attention runs.
* **Text masks** (Qwen-Image's padded prompts): diffusers' ring attention applies a rank's local mask to
  every rotated K/V chunk (wrong), and ring x Ulysses fails on a mask. A key mask is key validity, the
  same thing as the padding below: it travels in the same channel, per batch entry.
* **Sequences that do not divide by the degree.** diffusers' `*_anything` modes are missing before
  0.37/0.40, exclude ring x Ulysses, and add a size all-gather to every attention call; its plain modes
  assert divisibility. One path covers every layout: each stream (text, image) is padded so that every
  rank has ceil(L/N) tokens, at most one of them padding, and padded *keys* are dropped from every
  softmax (never unmasked padding). The key's validity travels through diffusers' collectives as one
  extra channel of Q/K/V, so the kernel can drop padded keys whichever rank's chunk it is given.
* **No accelerator on CPU.** diffusers 0.42 records `rank % torch.accelerator.device_count()` as the
  device (0 on CPU: ZeroDivisionError). `_accelerator_count_at_least_one` makes the count 1 only while
  `enable_parallelism` runs (and only when it is 0), then the real device is recorded. Nothing else in
  the process sees it; the device mesh is built here from the model's real device.

Supported diffusers: 0.36 (first `_cp_plan` / `enable_parallelism`) to 0.42; tested on 0.42.1.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError, ModelDims, ParallelLayout
from .comm import WaitCollectives, collectives_need_host, route_diffusers_gathers_through_host
from .lse import ANY, guard_forward_op, probe_merge_shape, probe_query_shape
from .lse_check import guard_ring_kernel
from .weights import compute_dtype

ATTENTION_KERNELS = ("cpu_flash", "math", "native_flash", "cudnn", "flash")


# --------------------------------------------------------------------------------------------------
# Attention kernels in diffusers' forward-op convention: (ctx, q, k, v, mask, dropout, causal, scale, gqa,
# return_lse, _save_ctx, _parallel_config) on [B, S, H, D] tensors; LSE in [B, S, H].


def cpu_flash_forward_op(
    ctx: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config: Any = None,
) -> Any:
    """The CPU flash kernel: the one CPU SDPA that returns the log-sum-exp (ring attention needs it)."""
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    out = out.transpose(1, 2)
    return (out, lse.transpose(1, 2)) if return_lse else out


def math_forward_op(
    ctx: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config: Any = None,
) -> Any:
    """Plain attention in float32 on any device and dtype (materialises the scores: a fallback)."""
    if dropout_p or is_causal:
        raise ValueError("the math attention kernel runs inference only: no dropout, not causal")
    q, k, v = (x.transpose(1, 2).float() for x in (query, key, value))
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if attn_mask is not None:
        scores = (
            scores.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else scores + attn_mask
        )
    lse = scores.logsumexp(-1)
    out = (torch.softmax(scores, -1) @ v).to(query.dtype).transpose(1, 2)
    return (out, lse.transpose(1, 2)) if return_lse else out


def _inference_only_backward_op(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("context-parallel attention in this pack runs inference only (no backward)")


@dataclass(frozen=True)
class AttentionKernel:
    name: str
    forward_op: Callable[..., Any]
    backward_op: Callable[..., Any]


def default_attention_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel for a device: ROCm flash SDPA (AOTriton), CUDA cuDNN, the CPU flash kernel.

    The GPU kernels take bfloat16/float16 only; float32 on a GPU (parity checks) runs the math kernel.
    """
    if device.type in ("cpu", "meta"):
        return "cpu_flash"
    if dtype not in (torch.bfloat16, torch.float16):
        return "math"
    return "native_flash" if torch.version.hip else "cudnn"


def choose_attention_kernel(
    device: torch.device, dtype: torch.dtype, override: str | None = None
) -> AttentionKernel:
    """The attention kernel for `device`/`dtype`, or the one named by `override` (see ATTENTION_KERNELS)."""
    name = override or default_attention_kernel(device, dtype)
    if name not in ATTENTION_KERNELS:
        raise ConfigError(f"attention={name!r} is not a known kernel; use {', '.join(ATTENTION_KERNELS)}")
    if name == "cpu_flash":
        return AttentionKernel(name, cpu_flash_forward_op, _inference_only_backward_op)
    if name == "math":
        return AttentionKernel(name, math_forward_op, _inference_only_backward_op)
    from diffusers.models import attention_dispatch as ad

    op = {
        "native_flash": "_native_flash_attention",
        "cudnn": "_cudnn_attention",
        "flash": "_flash_attention",
    }[name]
    forward, backward = getattr(ad, f"{op}_forward_op", None), getattr(ad, f"{op}_backward_op", None)
    if forward is None:
        raise ConfigError(
            f"attention={name!r} is not available in the installed diffusers; use cpu_flash or math"
        )
    # RDNA3/4 (gfx11xx/gfx12xx) need TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 for flash SDPA. torch reads it
    # once, at the first attention call, so it is set in one place only: the workers' environment
    # (client.WorkerGroup._worker_env, per GPU arch, before the process starts). A script that runs this
    # outside a worker group exports it itself.
    return AttentionKernel(name, forward, backward)


# --------------------------------------------------------------------------------------------------
# Padding sequences that do not divide by the degree


def split_sizes(length: int, degree: int) -> list[int]:
    """Real tokens per rank: `tensor_split`'s sizes (the first `length % degree` ranks get one more)."""
    return [len(r) for r in torch.arange(length).tensor_split(degree)]


def pad_for_ranks(x: torch.Tensor, dim: int, degree: int) -> torch.Tensor:
    """Pad each rank's piece of `x` along `dim` to ceil(L/N) with zeros: at most one pad token per rank."""
    width = math.ceil(x.shape[dim] / degree)
    pieces = []
    for piece in x.tensor_split(degree, dim=dim):
        missing = width - piece.shape[dim]
        if missing:
            shape = list(piece.shape)
            shape[dim] = missing
            piece = torch.cat([piece, piece.new_zeros(shape)], dim=dim)
        pieces.append(piece)
    return torch.cat(pieces, dim=dim)


def unpad_from_ranks(x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
    """Inverse of `pad_for_ranks`: keep the first `sizes[r]` tokens of every rank's equal piece."""
    pieces = x.chunk(len(sizes), dim=dim)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(pieces, sizes, strict=True)], dim=dim)


@dataclass(frozen=True)
class LocalPadding:
    """This rank's joint sequence [text | image] after padding, and which of its keys are real."""

    key_valid: torch.Tensor  # [S_local] 1.0 real, 0.0 padding
    image_sizes: tuple[int, ...]  # real image tokens on every rank (to unpad the gathered output)


def local_padding(text: int, image: int, degree: int, rank: int, device: torch.device) -> LocalPadding | None:
    if text % degree == 0 and image % degree == 0:
        return None
    text_sizes, image_sizes = split_sizes(text, degree), split_sizes(image, degree)
    text_width, image_width = math.ceil(text / degree), math.ceil(image / degree)
    valid = torch.zeros(text_width + image_width, device=device)
    valid[: text_sizes[rank]] = 1.0
    valid[text_width : text_width + image_sizes[rank]] = 1.0
    return LocalPadding(valid, tuple(image_sizes))


def masked_forward_op(inner: Callable[..., Any]) -> Callable[..., Any]:
    """Run `inner` on Q/K/V whose last channel is the extra validity channel: drop invalid keys first.

    Dropping (not masking) the invalid keys keeps the kernels mask-free (flash SDPA takes no mask) and is
    exact. K/V chunks of other ranks carry their own validity, so this works inside ring and Ulysses.
    Validity is the same for every head; it differs between batch entries only under a text mask (a CFG
    batch of a padded and an unpadded prompt): then each entry runs on its own keys.
    """

    def op(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if key.is_meta:
            # Sizing on the meta device: which keys are padding is data, and the boolean index below has no
            # meta kernel (nonzero). Keeping them all keeps the shapes of the padded local sequence, which
            # is what the collectives (run before this kernel) and the tracer see.
            entries: list[tuple[slice, Any]] = [(slice(None), slice(None))]
        else:
            keep = key[:, :, 0, -1] > 0.5  # [B, S]
            if bool((keep == keep[:1]).all()):
                entries = [(slice(None), keep[0])]
            else:
                entries = [(slice(b, b + 1), keep[b]) for b in range(keep.shape[0])]
        outs, rests = [], []
        for rows, kept in entries:
            result = inner(
                ctx, query[rows, ..., :-1], key[rows][:, kept, :, :-1], value[rows][:, kept, :, :-1], None,
                *args, **kwargs,
            )  # fmt: skip
            out, *rest = result if isinstance(result, tuple) else (result,)
            outs.append(out)
            rests.append(rest)
        out = nn.functional.pad(outs[0] if len(outs) == 1 else torch.cat(outs), (0, 1))
        if not rests[0]:
            return out
        rest = [r[0] if len(rests) == 1 else torch.cat(r) for r in zip(*rests, strict=True)]
        return (out, *rest)

    return op


# --------------------------------------------------------------------------------------------------
# The attention dispatch FLUX's processor calls


@dataclass
class ContextState:
    """What the attention calls of one model need: kernel, guard layout, and this forward's padding."""

    layout: ParallelLayout
    kernel: AttentionKernel
    lse_shape: str = ANY
    padding: LocalPadding | None = None
    return_dict: bool = False  # what the caller of this forward asked for
    # this forward's Q/K/V carry the validity channel (padding, or a text key mask somewhere in the whole
    # sequence): decided by the family's padding hook for every rank alike, or the collectives would differ
    masked: bool = False


class ContextAttention:
    """Stands in for diffusers' `dispatch_attention_fn` inside FLUX's attention processor."""

    def __init__(self, state: ContextState) -> None:
        self.state = state

    def forward_op(self, masked: bool) -> Callable[..., Any]:
        op = self.state.kernel.forward_op
        op = masked_forward_op(op) if masked else op
        return guard_forward_op(op, self.state.lse_shape) if self.state.layout.ring > 1 else op

    def local(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
    ) -> torch.Tensor:
        """Attention that is not split: diffusers passes no parallel config where attention stays local by
        design (Wan's cross-attention from this rank's tokens to the whole text, and to the image
        embedding): the device's kernel on what this rank holds, no ring, no padding channel."""
        return self.state.kernel.forward_op(
            None, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False
        )

    def key_validity(self, query: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor | None:
        """[B, S_local] which keys count: the processor's key mask (a text mask: Qwen-Image's builds a bool
        [B, 1, 1, S] over [text | image]) and the padding's; None when neither is given."""
        padding = self.state.padding
        if padding is not None and padding.key_valid.numel() != query.shape[1]:
            raise RuntimeError(
                f"local sequence {query.shape[1]} does not match the padding plan {padding.key_valid.numel()}"
            )
        valid = None if padding is None else (padding.key_valid > 0.5)[None, :].expand(query.shape[0], -1)
        if attn_mask is not None:
            b, s = query.shape[:2]
            if attn_mask.dtype != torch.bool or attn_mask.numel() not in (s, b * s):
                raise ValueError(
                    f"context-parallel attention takes a boolean key mask [B, 1, 1, S] (B={b}, S={s}); got "
                    f"{attn_mask.dtype} {tuple(attn_mask.shape)}"
                )
            keys = attn_mask.reshape(-1, s).expand(b, s)
            valid = keys if valid is None else valid & keys
        return valid

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        attention_kwargs: dict[str, Any] | None = None,
        *,
        backend: Any = None,
        parallel_config: Any = None,
    ) -> torch.Tensor:
        from diffusers.models.attention_dispatch import _templated_context_parallel_attention

        if parallel_config is None:
            return self.local(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        scale = query.shape[-1] ** -0.5 if scale is None else scale  # explicit: Q/K may gain a channel below
        valid = self.key_validity(query, attn_mask)
        masked = self.state.masked or self.state.padding is not None
        if valid is not None and not masked and not bool(valid.all()):
            # diffusers' own ring attention would apply this rank's mask to other ranks' keys: never that
            raise RuntimeError(
                "a key mask reached context-parallel attention in a forward its padding hook did not plan "
                "validity for (ContextState.masked); the family's ContextParallelSpec.padding must decide it"
            )
        if masked:
            # The validity channel: 0 in Q (so Q.K is unchanged), the flag in K, 0 in V.
            zeros = query.new_zeros((*query.shape[:-1], 1))
            flag = (
                torch.ones(key.shape[:2], dtype=key.dtype, device=key.device)
                if valid is None
                else valid.to(key.dtype)
            )
            flag = flag[:, :, None, None].expand(*key.shape[:-1], 1)
            query, key, value = (
                torch.cat([query, zeros], -1),
                torch.cat([key, flag], -1),
                torch.cat([value, zeros], -1),
            )
        out = _templated_context_parallel_attention(
            query, key, value, None, dropout_p, is_causal, scale, False, False,
            forward_op=self.forward_op(masked),
            backward_op=self.state.kernel.backward_op,
            _parallel_config=parallel_config,
        )  # fmt: skip
        return out[..., :-1] if masked else out


def _with_dispatch(fn: Callable[..., Any], dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of diffusers' processor function whose global `dispatch_attention_fn` is `dispatch`.

    Reuses the installed processor's code as is (projections, norms, RoPE and their version differences)
    and changes only the attention call, for this model only.
    """
    if "dispatch_attention_fn" not in fn.__code__.co_names:
        raise RuntimeError(
            f"{fn.__qualname__} does not call dispatch_attention_fn; this diffusers is not supported"
        )
    scope = dict(fn.__globals__, dispatch_attention_fn=dispatch)
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _processor_class(base: type) -> type:
    from diffusers.models.attention_dispatch import AttentionBackendName

    class ContextParallelProcessor(base):  # type: ignore[misc, valid-type]
        # Read only by enable_parallelism's check that the backend supports context parallelism; the
        # attention itself goes through ContextAttention.
        _attention_backend = AttentionBackendName.NATIVE

        def __init__(self, dispatch: ContextAttention) -> None:
            super().__init__()
            self._call = _with_dispatch(base.__call__, dispatch)

        # Never traced by a compiled block (compile.py): `_call` shares diffusers' code object under other
        # globals, which dynamo's per-code cache cannot tell apart (NameError on a resumed frame), and the
        # dispatch around the ring / Ulysses collectives is stateful Python. One deliberate break per call.
        @torch.compiler.disable
        def __call__(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
            return self._call(self, attn, *args, **kwargs)

    # Attention.forward filters joint_attention_kwargs by the processor's signature: keep the base's.
    ContextParallelProcessor.__call__.__signature__ = inspect.signature(base.__call__)  # type: ignore[attr-defined]
    ContextParallelProcessor.__name__ = f"ContextParallel{base.__name__}"
    return ContextParallelProcessor


def _install_processors(model: nn.Module, dispatch: ContextAttention, spec: ContextParallelSpec) -> int:
    classes: dict[type, type] = {}
    count = 0
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None:
            continue
        kind = type(processor)
        source = spec.processors.get(kind.__name__)
        if source is None or getattr(importlib.import_module(source), kind.__name__, None) is not kind:
            raise ConfigError(
                f"{name} uses the attention processor {kind.__name__}; context parallelism supports "
                f"{', '.join(spec.processors)} only (remove IP-adapters / custom processors first)"
            )
        if kind not in classes:
            classes[kind] = _processor_class(kind)
        module.set_processor(classes[kind](dispatch))
        count += 1
    return count


# --------------------------------------------------------------------------------------------------
# Padding uneven sequences around the model's forward


def _bind(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    arguments.update(arguments.pop("kwargs", {}))
    return arguments


def _output_class(spec: ContextParallelSpec) -> type:
    """What the model's forward returns with return_dict=True: `spec.output_class` ('module.Class')."""
    module, _, name = spec.output_class.rpartition(".")
    return getattr(importlib.import_module(module), name)


def pad_token_streams(model: nn.Module, state: ContextState, spec: ContextParallelSpec) -> None:
    """Pad the text and image streams before diffusers splits them; unpad the gathered output.

    For forwards taking `hidden_states` and `encoder_hidden_states` [B, S, C] and position ids that the
    model's root `_cp_plan` splits (FLUX.1, FLUX.2); a family whose positions come another way brings
    its own function as `ContextParallelSpec.padding`.
    """
    degree = state.layout.ring * state.layout.ulysses
    cp_config = model._parallel_config.context_parallel_config
    root_plan = type(model)._cp_plan.get("", {})
    id_layout = {
        ids: (root_plan[ids].expected_dims or 2, root_plan[ids].split_dim)
        for ids in ("img_ids", "txt_ids")
        if ids in root_plan
    }

    def pad_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kw = _bind(module, args, kwargs)
        image, text = kw["hidden_states"], kw["encoder_hidden_states"]
        state.layout.validate_sequence(image.shape[1])
        # Bring the ids to the rank the model's _cp_plan splits: FLUX.1 plans 2-D ids [S, 3] (batched
        # ids are deprecated there), FLUX.2 plans batched ids [B, S, 4] split on dim 1. Ids of the
        # other rank would be passed whole to every rank: wrong rotary positions, silently.
        for ids, (ndim, _dim) in id_layout.items():
            if kw.get(ids) is None:
                continue
            while kw[ids].ndim > ndim:
                kw[ids] = kw[ids][0]
            while kw[ids].ndim < ndim:
                kw[ids] = kw[ids].unsqueeze(0)
        # diffusers' split hook on the root rejects a Transformer2DModelOutput: run with return_dict=False
        # and rebuild the output object for the caller afterwards.
        state.return_dict = bool(kw.get("return_dict", True))
        kw["return_dict"] = False
        rank = dist.get_rank(cp_config._flattened_mesh.get_group())
        state.padding = local_padding(text.shape[1], image.shape[1], degree, rank, image.device)
        if state.padding is not None:
            kw["hidden_states"] = pad_for_ranks(image, 1, degree)
            kw["encoder_hidden_states"] = pad_for_ranks(text, 1, degree)
            for ids, (_ndim, dim) in id_layout.items():
                kw[ids] = pad_for_ranks(kw[ids], dim, degree)
        return (), kw

    def unpad_output(module: nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> Any:
        padding, state.padding = state.padding, None
        sample = output[0] if padding is None else unpad_from_ranks(output[0], 1, list(padding.image_sizes))
        if state.return_dict:
            return output_class(sample=sample)
        return (sample, *output[1:])

    output_class = _output_class(spec)
    model.register_forward_pre_hook(pad_inputs, with_kwargs=True)
    model.register_forward_hook(unpad_output)


# --------------------------------------------------------------------------------------------------
# A family's spec


@dataclass(frozen=True)
class ContextParallelSpec:
    """What context parallelism needs from a family (its `cp`); the sequence split itself is the diffusers
    class's own `_cp_plan`.

    - `processors`: diffusers attention processor class name -> the module that defines it. Each is
      rebuilt with its module-level `dispatch_attention_fn` redirected; nothing else of it changes.
    - `output_class`: 'module.Class' of what the model's forward returns with return_dict=True.
    - `padding(model, state, spec)`: installs the hooks that pad uneven sequences for the ranks and unpad
      the gathered output (`pad_token_streams` for FLUX-style forwards).
    """

    processors: Mapping[str, str]
    output_class: str = "diffusers.models.modeling_outputs.Transformer2DModelOutput"
    padding: Callable[[nn.Module, ContextState, ContextParallelSpec], None] = pad_token_streams


# --------------------------------------------------------------------------------------------------
# Entry point


@contextmanager
def _accelerator_count_at_least_one() -> Iterator[None]:
    """diffusers 0.42 computes `rank % torch.accelerator.device_count()`: 0 on a CPU-only torch.

    For the duration of the block only, and only when the count is 0, report 1. The value is used to
    name a device diffusers merely records (we overwrite it with the real one afterwards).
    """
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or accelerator.device_count() > 0:
        yield
        return
    original = accelerator.device_count
    accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        accelerator.device_count = original


def _model_device(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, compute_dtype(model)  # not p.dtype: fp8-resident weights compute in another dtype


def _world_mesh(device: torch.device, ring: int, ulysses: int) -> Any:
    # On the meta device (sizing under the fake group) collectives run on CPU tensors.
    device_type = "cpu" if device.type == "meta" else device.type
    return dist.device_mesh.init_device_mesh(device_type, (ring, ulysses), mesh_dim_names=("ring", "ulysses"))


def _check_mesh(mesh: Any, ring: int, ulysses: int) -> None:
    """diffusers takes the ring's chunk count from `ring_degree` and its ranks from the mesh, and checks
    only ring x ulysses <= world size: a sub-mesh of another shape would chunk K/V wrongly, silently."""
    names = tuple(mesh.mesh_dim_names or ())
    if names != ("ring", "ulysses") or tuple(mesh.shape) != (ring, ulysses):
        raise ValueError(
            f"context parallelism needs the ('ring', 'ulysses') mesh of shape ({ring}, {ulysses}); got "
            f"{names} of shape {tuple(mesh.shape)}"
        )


def cp_group(model: nn.Module) -> Any:
    """The process group diffusers splits the sequence and gathers the output on (ring x ulysses
    flattened), or None when the model is not context-parallel."""
    config = getattr(model, "_parallel_config", None)
    cp_config = getattr(config, "context_parallel_config", None)
    mesh = getattr(cp_config, "_flattened_mesh", None)
    return None if mesh is None else mesh.get_group()


def probe_ring(config: Any, device: torch.device, chunks: int) -> str:
    """Ask the installed TemplatedRingAttention which LSE rank its merge accepts, on diffusers' parallel
    `config` of `chunks` ring ranks (collective, tiny)."""
    from diffusers.models.attention_dispatch import TemplatedRingAttention

    probe_device = torch.device("cpu") if device.type == "meta" else device
    q = torch.zeros(probe_query_shape(), device=probe_device)

    def run_ring(op: Callable[..., Any]) -> torch.Tensor:
        return TemplatedRingAttention.apply(q, q, q, None, 0.0, False, None, False, False, op, None, config)

    with WaitCollectives():  # the probe's kernel ignores the gathered K/V: nothing else would wait
        return probe_merge_shape(run_ring, chunks=chunks)


def apply_context_parallel(
    model: nn.Module,
    ring_degree: int = 1,
    ulysses_degree: int = 1,
    *,
    spec: ContextParallelSpec,
    dims: ModelDims,
    mesh: Any = None,
    attention: str | None = None,
) -> nn.Module:
    """Split the model's token sequence over `mesh`, a ("ring", "ulysses") device mesh of shape
    (ring_degree, ulysses_degree): the layout's sub-mesh (parallel/mesh.py), or, when None, one over the
    whole default process group (ring x Ulysses = world size).

    Collective: every rank of the mesh calls it with the same arguments. A model already tensor-parallel
    keeps its shards: Ulysses then splits the heads each rank holds. `attention` overrides the kernel
    chosen for the device (one of ATTENTION_KERNELS). `spec` is the model's family's `cp` and `dims` its
    `dims(config)`: the caller that knows the family passes them down (`ModelFamily.context_parallel`).
    Returns the model, whose forward then takes and returns full tensors on every rank (inputs are split
    and the output gathered by diffusers' hooks).
    """
    tp = getattr(model, "_rp_tensor_parallel", None)
    layout = ParallelLayout(tp=tp.degree if tp is not None else 1, ring=ring_degree, ulysses=ulysses_degree)
    layout.validate(dims)
    world = dist.get_world_size()
    if mesh is None and layout.cp not in (1, world):
        raise ConfigError(
            f"ring_degree={ring_degree} x ulysses_degree={ulysses_degree} = {layout.cp} but the process group "
            f"has {world} ranks; make the product {world}, or pass the layout's ('ring', 'ulysses') sub-mesh "
            "(parallel/mesh.py parallel_groups(...).cp_mesh)"
        )
    if layout.cp == 1:
        return model
    from diffusers import ContextParallelConfig

    device, dtype = _model_device(model)
    state = ContextState(layout=layout, kernel=choose_attention_kernel(device, dtype, attention))
    _install_processors(model, ContextAttention(state), spec)
    options: dict[str, Any] = {"ring_degree": layout.ring, "ulysses_degree": layout.ulysses}
    has_mesh = "mesh" in {f.name for f in dataclasses.fields(ContextParallelConfig)}  # diffusers >= 0.37
    if mesh is not None:
        _check_mesh(mesh, layout.ring, layout.ulysses)
        if not has_mesh and layout.cp != dist.get_world_size():
            raise ConfigError(
                "this diffusers builds its own context-parallel mesh over every rank, so it cannot be "
                "combined with tp or batch degrees; update diffusers (0.37 or newer)"
            )
    if has_mesh:
        options["mesh"] = mesh if mesh is not None else _world_mesh(device, layout.ring, layout.ulysses)
    with _accelerator_count_at_least_one():
        model.enable_parallelism(config=ContextParallelConfig(**options))
    model._parallel_config._device = device
    model._parallel_config.context_parallel_config._device = device
    if collectives_need_host(dist.get_backend(cp_group(model)), device):
        route_diffusers_gathers_through_host()  # before the probe and the guard, which gather too
    if layout.ring > 1:
        state.lse_shape = probe_ring(model._parallel_config, device, layout.ring)
        # the numeric LSE guard (lse_check.py): the kernel against float64, then through this ring's merge
        state.kernel = guard_ring_kernel(
            state.kernel, model._parallel_config, device, dtype, state.lse_shape, dims.head_dim
        )
    spec.padding(model, state, spec)
    model._rp_context_state = state  # for inspection (tests, benchmarks)
    return model
