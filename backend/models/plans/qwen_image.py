"""Qwen-Image (and Qwen-Image-Edit, -Edit-2509, -Edit-2511) as a plan over ComfyUI's own
`comfy.ldm.qwen_image.model.QwenImageTransformer2DModel` (comfy/ldm/qwen_image/model.py, 0.3.75 and 0.33.0).

ComfyUI detects it by `txt_norm.weight` (`unet_config["image_model"] == "qwen_image"`); the Edit models are the
same class with other inputs (reference latents), Edit-2511 only changes the default reference method. What
each module is, and why it is split so:

- `transformer_blocks.N.attn.{to_q,to_k,to_v}` (image stream) and `.add_{q,k,v}_proj` (text stream): one
  linear per projection, nothing fused -> Columns(), each rank its heads. The q/k RMS norms (`norm_q`,
  `norm_k`, `norm_added_q`, `norm_added_k`) are over head_dim, per head: whole on every rank.
- `.attn.to_out.0` and `.attn.to_add_out` read a rank's heads -> Rows; the MLPs (`{img,txt}_mlp.net.0.proj`
  GELU(tanh) 4 x hidden, `.net.2` back) -> Columns / Rows.
- The AdaLN modulation: `{img,txt}_mod.1` (Linear(hidden, 6 x hidden) per stream and block: 6.8 B of
  Qwen-Image's 20.4 B parameters) and the final `norm_out.linear` all read silu(temb): one bank, one
  all-gather per forward. (Edit-2511's index_timestep_zero hands `img_mod` temb with the timestep-0 rows
  appended and the others the first half: those gather alone, by the bank's shape rule.)
- `Attention.forward` reshapes q / k / v by `self.heads`: the local head count goes on every `attn`. The root
  holds no head count: `heads` names a block's `num_attention_heads`, which no forward reads (whole).
- Context parallelism: no method of the class carries the streams (`_forward` patchifies, appends the
  reference latents to the image tokens, embeds and computes the RoPE of cat(text ids, image ids) in one
  body), so the split is at the blocks (BlockSplit): the image tokens (`hidden_states`: the latent's, then
  every reference latent's) and the text tokens (`encoder_hidden_states`) split at the first block; at every
  block the RoPE (`image_rotary_emb`, [B, 1, text + image, head_dim / 2, 2, 2]) is cut into its text and
  image parts and each split like its tokens, the text mask (0.33: additive, [B, text]) like the text, and
  Edit-2511's `timestep_zero_index` (where the reference tokens start) becomes the rank's local index.
  `Attention` concatenates cat(text, image) for the joint attention: the text stream comes first. The image
  tokens come back whole at `proj_out`'s output, before `_forward` cuts them to the latent's own tokens.
  A ControlNet's residuals are added by token position: refused under ring / Ulysses.
"""

from __future__ import annotations

from ..plan import BlockSplit, Columns, Gathered, ModelPlan, Rows, Split, Stream

QWEN_IMAGE_CLASS = "comfy.ldm.qwen_image.model.QwenImageTransformer2DModel"
TEMB = "temb"  # the modulation bank: every AdaLN linear reads silu(temb)

_BLOCK = "transformer_blocks.*"
_LINEARS: dict[str, Split] = {
    **{f"{_BLOCK}.attn.{name}": Columns() for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")},
    f"{_BLOCK}.attn.to_out.0": Rows(),
    f"{_BLOCK}.attn.to_add_out": Rows(),
    f"{_BLOCK}.img_mlp.net.0.proj": Columns(),
    f"{_BLOCK}.img_mlp.net.2": Rows(),
    f"{_BLOCK}.txt_mlp.net.0.proj": Columns(),
    f"{_BLOCK}.txt_mlp.net.2": Rows(),
    f"{_BLOCK}.img_mod.1": Gathered(TEMB),
    f"{_BLOCK}.txt_mod.1": Gathered(TEMB),
    "norm_out.linear": Gathered(TEMB),
}  # fmt: skip

_SEQUENCE = BlockSplit(
    blocks=_BLOCK,
    streams=(Stream("txt", ("encoder_hidden_states",)), Stream("img", ("hidden_states",))),
    joint={"image_rotary_emb": 2},
    masks={"encoder_hidden_states_mask": "txt"},
    indices={"timestep_zero_index": "img"},
    output="proj_out",
    output_stream="img",
    refused={"control": "a ControlNet adds its residuals by token position; use layout 'tp'"},
)

QWEN_IMAGE = ModelPlan(
    name="Qwen-Image",
    model_class=QWEN_IMAGE_CLASS,
    when={"image_model": "qwen_image"},
    heads="transformer_blocks.0.num_attention_heads",
    width="inner_dim",
    linears=_LINEARS,
    per_rank={f"{_BLOCK}.attn": ("heads",)},
    blocks=("QwenImageTransformerBlock",),
    sequence=_SEQUENCE,
    attention=(_BLOCK,),
    unbatched=("ref_latents_method",),
)

PLANS = (QWEN_IMAGE,)

__all__ = ["PLANS", "QWEN_IMAGE", "QWEN_IMAGE_CLASS"]
