"""Test-only ComfyUI nodes for the Wan graphs (copied into the tier's custom_nodes/ by comfy_server.py).

No umt5, CLIP-H or Wan VAE weights exist here, so the graphs take what those nodes would give from seeded
stand-ins and run ComfyUI's own Wan nodes on them unchanged (EmptyHunyuanLatentVideo, WanImageToVideo,
Wan22ImageToVideoLatent, ModelSamplingSD3, KSampler, KSamplerAdvanced):

* RPTestWanText: a CONDITIONING as CLIPTextEncode with the wan text encoder makes it ([1, tokens, 4096], no
  pooled vector);
* RPTestWanImage: an IMAGE of `frames` frames;
* RPTestWanVAE: a VAE whose `encode(pixels)` returns a Wan VAE's latent shape ([1, C, 1 + (N - 1) // 4,
  H / s, W / s]: every 4th frame, s x s average pooling, a fixed mix of the RGB channels): all that
  WanImageToVideo and Wan22ImageToVideoLatent call;
* RPTestWanClipVision: a CLIP_VISION_OUTPUT whose `penultimate_hidden_states` is [1, tokens, 1280] (what
  WAN21.extra_conds reads; CLIP-H gives 257 tokens).
"""

import torch
import torch.nn.functional as F


class RPTestWanText:
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "tokens": ("INT", {"default": 512, "min": 1})}}

    def load(self, seed, tokens):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, 4096, generator=g), {"pooled_output": None}]],)


class RPTestWanImage:
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "seed": ("INT", {"default": 0}),
                "width": ("INT", {"default": 64}),
                "height": ("INT", {"default": 64}),
                "frames": ("INT", {"default": 1}),
            }
        }

    def load(self, seed, width, height, frames):
        g = torch.Generator().manual_seed(seed)
        return (torch.rand(frames, height, width, 3, generator=g),)


class _StubVAE:
    def __init__(self, channels, scale, seed):
        self.scale = scale
        self.mix = torch.randn(3, channels, generator=torch.Generator().manual_seed(seed))

    def encode(self, pixels):
        frames = pixels[::4].movedim(-1, 1).float()  # [1 + (N - 1) // 4, 3, H, W]
        pooled = F.avg_pool2d(frames, self.scale)
        return torch.einsum("tchw,cd->dthw", pooled, self.mix).unsqueeze(0).contiguous()


class RPTestWanVAE:
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("VAE",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "channels": ("INT", {"default": 16}),
                "scale": ("INT", {"default": 8}),
                "seed": ("INT", {"default": 0}),
            }
        }

    def load(self, channels, scale, seed):
        return (_StubVAE(channels, scale, seed),)


class _ClipVisionOutput:
    def __init__(self, states):
        self.penultimate_hidden_states = states


class RPTestWanClipVision:
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("CLIP_VISION_OUTPUT",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "tokens": ("INT", {"default": 257})}}

    def load(self, seed, tokens):
        g = torch.Generator().manual_seed(seed)
        return (_ClipVisionOutput(torch.randn(1, tokens, 1280, generator=g)),)


NODE_CLASS_MAPPINGS = {
    "RPTestWanText": RPTestWanText,
    "RPTestWanImage": RPTestWanImage,
    "RPTestWanVAE": RPTestWanVAE,
    "RPTestWanClipVision": RPTestWanClipVision,
}
