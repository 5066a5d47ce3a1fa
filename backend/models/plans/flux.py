"""FLUX.1 and FLUX.2 as plans over ComfyUI's own `comfy.ldm.flux.model.Flux` (comfy/ldm/flux/layers.py).

ComfyUI runs both with one class; its detection tells them apart (`unet_config["image_model"]`: "flux" or
"flux2"). What each module is, and why it is split so:

- `double_blocks.N.{img,txt}_attn.qkv`: q | k | v stacked (3 x hidden), each split by heads -> Columns(3).
  The per-head q/k RMS norms (`.norm.query_norm`, `.norm.key_norm`, over head_dim) are whole on every rank.
- `.{img,txt}_attn.proj` (hidden x hidden) and `.{img,txt}_mlp.2` read a rank's heads / MLP features -> Rows.
- `.{img,txt}_mlp.0`: FLUX.1's GELU MLP -> Columns(); FLUX.2's SiLU-gated MLP writes gate | up, which
  ComfyUI's SiLUActivation halves -> Columns(2).
- `single_blocks.N.linear1`: q | k | v | mlp fused (FLUX.2: q | k | v | gate | up): each part split; the
  block splits the local output by `hidden_size` and `mlp_hidden_dim_first`, so those shrink per rank too.
  `.linear2` reads cat(attention, mlp): Rows over both parts (a contiguous split would pair one rank's
  attention columns with another's activations: silent noise).
- Every AdaLN modulation linear (FLUX.1: `img_mod`, `txt_mod`, single `modulation`, the final layer's
  `adaLN_modulation.1`; FLUX.2: the three shared `*_stream_modulation` and the final layer's) reads the same
  silu(vec): one bank, one all-gather per forward.
- Blocks reshape q / k / v by `self.num_heads` (ComfyUI's attention takes heads from q's shape): the local
  head count is set on every block (and on SelfAttention, for honesty).
- Context parallelism: `forward_orig(img, img_ids, txt, txt_ids, ...)` carries both streams after
  patchify and position ids; the blocks attend over cat(txt, img), so the text stream comes first. Its
  output is the image tokens. FLUX.2's timestep-zero reference modulation (`timestep_zero_index`) and a
  ControlNet's residuals index tokens globally: refused under ring / Ulysses.
"""

from __future__ import annotations

from ..plan import Columns, Gathered, ModelPlan, Rows, SequenceSplit, Split, Stream

FLUX_CLASS = "comfy.ldm.flux.model.Flux"
VEC = "vec"  # the modulation bank: every AdaLN linear reads silu(vec)

_ATTENTION: dict[str, Split] = {
    "double_blocks.*.img_attn.qkv": Columns(3),
    "double_blocks.*.txt_attn.qkv": Columns(3),
    "double_blocks.*.img_attn.proj": Rows(),
    "double_blocks.*.txt_attn.proj": Rows(),
    "double_blocks.*.img_mlp.2": Rows(),
    "double_blocks.*.txt_mlp.2": Rows(),
}
_HEADS = {
    "double_blocks.*": ("num_heads",),
    "double_blocks.*.img_attn": ("num_heads",),
    "double_blocks.*.txt_attn": ("num_heads",),
    "single_blocks.*": ("num_heads", "hidden_size", "mlp_hidden_dim", "mlp_hidden_dim_first"),
}
_SEQUENCE = SequenceSplit(
    method="forward_orig",
    streams=(Stream("txt", ("txt", "txt_ids")), Stream("img", ("img", "img_ids"))),
    output="img",
    refused={
        "timestep_zero_index": "FLUX.2's 'index_timestep_zero' reference method modulates reference tokens by "
        "their place in the whole sequence; use ref_latents_method 'index' or 'offset', or layout 'tp'",
        "control": "a ControlNet adds its residuals by token position; use layout 'tp'",
        "attn_mask": "an attention mask over the whole sequence; use layout 'tp'",
    },
)
_COMMON = {
    "heads": "num_heads",
    "width": "hidden_size",
    "model_class": FLUX_CLASS,
    "per_rank": _HEADS,
    "blocks": ("DoubleStreamBlock", "SingleStreamBlock"),
    "sequence": _SEQUENCE,
    "attention": ("double_blocks.*", "single_blocks.*"),
    "unbatched": ("ref_latents_method",),
}

FLUX1 = ModelPlan(
    name="FLUX.1",
    when={"image_model": "flux"},
    linears={
        **_ATTENTION,
        "double_blocks.*.img_mod.lin": Gathered(VEC),
        "double_blocks.*.txt_mod.lin": Gathered(VEC),
        "double_blocks.*.img_mlp.0": Columns(),
        "double_blocks.*.txt_mlp.0": Columns(),
        "single_blocks.*.modulation.lin": Gathered(VEC),
        "single_blocks.*.linear1": Columns(("hidden_size",) * 3 + ("mlp_hidden_dim_first",)),
        "single_blocks.*.linear2": Rows(("hidden_size", "mlp_hidden_dim")),
        "final_layer.adaLN_modulation.1": Gathered(VEC),
    },
    **_COMMON,
)

FLUX2 = ModelPlan(
    name="FLUX.2",
    when={"image_model": "flux2"},
    linears={
        **_ATTENTION,
        "double_stream_modulation_img.lin": Gathered(VEC),
        "double_stream_modulation_txt.lin": Gathered(VEC),
        "single_stream_modulation.lin": Gathered(VEC),
        "double_blocks.*.img_mlp.0": Columns(2),
        "double_blocks.*.txt_mlp.0": Columns(2),
        "single_blocks.*.linear1": Columns(("hidden_size",) * 3 + ("mlp_hidden_dim",) * 2),
        "single_blocks.*.linear2": Rows(("hidden_size", "mlp_hidden_dim")),
        "final_layer.adaLN_modulation.1": Gathered(VEC),
    },
    **_COMMON,
)

PLANS = (FLUX1, FLUX2)

__all__ = ["FLUX1", "FLUX2", "FLUX_CLASS", "PLANS"]
