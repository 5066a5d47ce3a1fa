"""Model shapes and bytes: diffusers' parameter shapes from the dims, sharded with the engine's own plan."""

from __future__ import annotations

import math

from ..config import FluxDims, ParallelLayout

TIMESTEP_CHANNELS = 256  # diffusers' Timesteps(num_channels=256) in FLUX's time/guidance embedders


def flux_parameter_shapes(dims: FluxDims) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of diffusers' FluxTransformer2DModel with these dims.

    Written out instead of building the model so the client can plan without diffusers; the test checks
    it equals the state dict of a meta model, name for name.
    """
    d, m, hd = dims.hidden, dims.mlp, dims.head_dim
    ff = 4 * d  # diffusers' FeedForward(mult=4) in the double blocks, whatever mlp_ratio says
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, fan_in: int, fan_out: int) -> None:
        shapes[f"{name}.weight"] = (fan_out, fan_in)
        shapes[f"{name}.bias"] = (fan_out,)

    embedders = ["timestep_embedder"] + (["guidance_embedder"] if dims.guidance else [])
    for emb in embedders:
        linear(f"time_text_embed.{emb}.linear_1", TIMESTEP_CHANNELS, d)
        linear(f"time_text_embed.{emb}.linear_2", d, d)
    linear("time_text_embed.text_embedder.linear_1", dims.pooled_dim, d)
    linear("time_text_embed.text_embedder.linear_2", d, d)
    linear("context_embedder", dims.text_dim, d)
    linear("x_embedder", dims.in_channels, d)
    for i in range(dims.double_blocks):
        p = f"transformer_blocks.{i}"
        linear(f"{p}.norm1.linear", d, 6 * d)
        linear(f"{p}.norm1_context.linear", d, 6 * d)
        for norm in ("norm_q", "norm_k"):
            shapes[f"{p}.attn.{norm}.weight"] = (hd,)
        for proj in ("to_q", "to_k", "to_v"):
            linear(f"{p}.attn.{proj}", d, d)
        linear(f"{p}.attn.to_out.0", d, d)
        for norm in ("norm_added_q", "norm_added_k"):
            shapes[f"{p}.attn.{norm}.weight"] = (hd,)
        for proj in ("add_q_proj", "add_k_proj", "add_v_proj"):
            linear(f"{p}.attn.{proj}", d, d)
        linear(f"{p}.attn.to_add_out", d, d)
        for stream in ("ff", "ff_context"):
            linear(f"{p}.{stream}.net.0.proj", d, ff)
            linear(f"{p}.{stream}.net.2", ff, d)
    for i in range(dims.single_blocks):
        p = f"single_transformer_blocks.{i}"
        linear(f"{p}.norm.linear", d, 3 * d)
        linear(f"{p}.proj_mlp", d, m)
        linear(f"{p}.proj_out", d + m, d)
        for norm in ("norm_q", "norm_k"):
            shapes[f"{p}.attn.{norm}.weight"] = (hd,)
        for proj in ("to_q", "to_k", "to_v"):
            linear(f"{p}.attn.{proj}", d, d)
    linear("norm_out.linear", d, 2 * d)
    linear("proj_out", d, dims.in_channels)
    return shapes


def flux2_parameter_shapes(dims: FluxDims) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of diffusers' Flux2Transformer2DModel (0.42.1) with these dims.

    No biases; the modulation linears are shared by all blocks (three at the top level); SwiGLU
    feed-forwards read d and write [gate | up] = 2 x mlp; single blocks fuse q, k, v and the MLP input
    into one projection and the attention and MLP outputs into another.
    """
    d, m, hd = dims.hidden, dims.mlp, dims.head_dim
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, fan_in: int, fan_out: int) -> None:
        shapes[f"{name}.weight"] = (fan_out, fan_in)

    embedders = ["timestep_embedder"] + (["guidance_embedder"] if dims.guidance else [])
    for emb in embedders:
        linear(f"time_guidance_embed.{emb}.linear_1", TIMESTEP_CHANNELS, d)
        linear(f"time_guidance_embed.{emb}.linear_2", d, d)
    linear("double_stream_modulation_img.linear", d, 6 * d)
    linear("double_stream_modulation_txt.linear", d, 6 * d)
    linear("single_stream_modulation.linear", d, 3 * d)
    linear("x_embedder", dims.in_channels, d)
    linear("context_embedder", dims.text_dim, d)
    for i in range(dims.double_blocks):
        p = f"transformer_blocks.{i}"
        for proj in ("to_q", "to_k", "to_v"):
            linear(f"{p}.attn.{proj}", d, d)
        for norm in ("norm_q", "norm_k"):
            shapes[f"{p}.attn.{norm}.weight"] = (hd,)
        linear(f"{p}.attn.to_out.0", d, d)
        for norm in ("norm_added_q", "norm_added_k"):
            shapes[f"{p}.attn.{norm}.weight"] = (hd,)
        for proj in ("add_q_proj", "add_k_proj", "add_v_proj"):
            linear(f"{p}.attn.{proj}", d, d)
        linear(f"{p}.attn.to_add_out", d, d)
        for stream in ("ff", "ff_context"):
            linear(f"{p}.{stream}.linear_in", d, 2 * m)
            linear(f"{p}.{stream}.linear_out", m, d)
    for i in range(dims.single_blocks):
        p = f"single_transformer_blocks.{i}"
        linear(f"{p}.attn.to_qkv_mlp_proj", d, 3 * d + 2 * m)
        for norm in ("norm_q", "norm_k"):
            shapes[f"{p}.attn.{norm}.weight"] = (hd,)
        linear(f"{p}.attn.to_out", d + m, d)
    linear("norm_out.linear", d, 2 * d)
    linear("proj_out", d, dims.in_channels)
    return shapes


def parameter_shapes(dims: FluxDims, family: str = "flux1") -> dict[str, tuple[int, ...]]:
    return flux2_parameter_shapes(dims) if family == "flux2" else flux_parameter_shapes(dims)


def weight_bytes(
    dims: FluxDims,
    layout: ParallelLayout,
    dtype_bytes: int,
    rank: int = 0,
    family: str = "flux1",
    linear_bytes: int | None = None,
) -> int:
    """Parameter bytes one rank holds in `layout`: a TP shard, or the full model under context parallelism.

    `family`: the model family whose shapes and TP plan count ("flux1", "flux2"). `linear_bytes`: bytes
    per element of the linear weights (the 2-D parameters) when they are held in another dtype than the
    rest (fp8 weights: 1); biases and norm scales always take `dtype_bytes`, as in the loader
    (load.resident_dtype).
    """
    linear = dtype_bytes if linear_bytes is None else linear_bytes
    from ..parallel.tensor import FLUX2_TP_PLAN, FLUX_TP_PLAN, _pattern, shard_pieces

    shapes = parameter_shapes(dims, family)
    if layout.tp == 1:
        return sum((linear if len(s) == 2 else dtype_bytes) * math.prod(s) for s in shapes.values())
    tp_plan = FLUX2_TP_PLAN if family == "flux2" else FLUX_TP_PLAN
    patterns = [(_pattern(k), split) for k, split in tp_plan.items()]
    total = 0
    for name, shape in shapes.items():
        module, _, param = name.rpartition(".")
        split = next((s for rx, s in patterns if rx.match(module)), None)
        pieces = None if split is None else shard_pieces(split, param, shape, rank, layout.tp, dims)
        total += (linear if len(shape) == 2 else dtype_bytes) * math.prod(
            shape if pieces is None else pieces.shape(shape)
        )
    return total
