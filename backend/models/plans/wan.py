"""Wan 2.1 and Wan 2.2 (T2V, I2V, each A14B expert, TI2V 5B) as a plan over ComfyUI's own
`comfy.ldm.wan.model.WanModel` (comfy/ldm/wan/model.py).

ComfyUI runs every one of them with this class; its detection reads the widths from the shapes and the head
count as dim // 128, unless the file's metadata says otherwise (`metadata["config"]["transformer"]`, read
by ComfyUI 0.33; e.g. 12 heads of 64): the engine builds from that detection, so the heads are the file's.
What each module is, and why it is split so:

- `blocks.N.self_attn.{q,k,v}` (dim x dim, heads side by side) -> Columns; `.o` reads a rank's heads -> Rows.
  `.norm_q` / `.norm_k` are RMS norms over all heads at once (ComfyUI's RMSNorm(dim)) -> HeadNorm: a
  per-rank norm would normalise each rank's heads alone, silently.
- `blocks.N.cross_attn`: the video tokens' queries against the text (umt5) and, for I2V, the CLIP image
  tokens (`k_img`, `v_img`, `norm_k_img`, absent from T2V, both A14B experts and TI2V 5B: `optional`): the same
  column / row / HeadNorm split by heads. Its keys and values are never split with the tokens: it is not in
  `attention`, so its attention stays ComfyUI's own, on this rank's queries and the whole text.
- `blocks.N.ffn.0` (GELU tanh) -> Columns, `.ffn.2` -> Rows.
- `time_projection.1` (dim -> 6 x dim, 157 M parameters in the 14B) reads silu(e) once per forward: Gathered.
  The blocks' own `modulation` tables (6 x dim) are added to its output, whole on every rank.
- The patch embedding (Conv3d, float32 in ComfyUI), the text, time and image embedders and the head stay
  whole on every rank.
- The attention modules reshape q / k / v by `num_heads` (ComfyUI's attention takes heads from it): the local
  head count is set on them.
- Context parallelism: `forward_orig` makes the tokens itself (patch embedding of the whole latent video,
  flattened frames x rows x columns), so they are split where they enter the first block (`TokenSplit`):
  each block and the head get this rank's tokens, the RoPE table (`freqs`, one row per token: frames, rows,
  columns) cut alike, and the time modulation `e` cut to the rows of this rank's tokens: one row for all
  tokens (left whole), or Wan 2.2's one per latent frame (TI2V 5B with a start image), which ComfyUI's
  `repeat_e` spreads over each frame's tokens, so the rank takes the frames of its own tokens. The head's
  output is gathered before unpatchify. Only the self-attention spans the split sequence.
"""

from __future__ import annotations

from ..plan import Columns, Gathered, HeadNorm, ModelPlan, Rows, Split, TokenSplit

WAN_CLASS = "comfy.ldm.wan.model.WanModel"

_ATTENTION = ("self_attn", "cross_attn")
_IMAGE = ("blocks.*.cross_attn.k_img", "blocks.*.cross_attn.v_img", "blocks.*.cross_attn.norm_k_img")

_LINEARS: dict[str, Split] = {
    **{f"blocks.*.{a}.{p}": Columns() for a in _ATTENTION for p in ("q", "k", "v")},
    **{f"blocks.*.{a}.o": Rows() for a in _ATTENTION},
    "blocks.*.cross_attn.k_img": Columns(),
    "blocks.*.cross_attn.v_img": Columns(),
    "blocks.*.ffn.0": Columns(),
    "blocks.*.ffn.2": Rows(),
    "time_projection.1": Gathered(),
}
_NORMS = {
    **{f"blocks.*.{a}.{n}": HeadNorm() for a in _ATTENTION for n in ("norm_q", "norm_k")},
    "blocks.*.cross_attn.norm_k_img": HeadNorm(),
}

WAN = ModelPlan(
    name="Wan",
    model_class=WAN_CLASS,
    heads="num_heads",
    width="dim",
    linears=_LINEARS,
    norms=_NORMS,
    per_rank={f"blocks.*.{a}": ("num_heads",) for a in _ATTENTION},
    sequence=TokenSplit(
        modules=("blocks.*", "head"),
        tokens="x",
        rows=("e", "freqs"),
        gather="head",
        spread="comfy.ldm.wan.model.repeat_e",
    ),
    attention=("blocks.*.self_attn",),
    blocks=("WanAttentionBlock",),
    optional=_IMAGE,
)

PLANS = (WAN,)

__all__ = ["PLANS", "WAN", "WAN_CLASS"]
