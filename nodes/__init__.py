"""ComfyUI node classes (classes.py): thin wrappers over plain-Python modules, one per job, and through
them the backend: inputs.py (widgets, the handle between nodes), registry.py (the resident worker groups
and the panel's state), loading.py (start, load, 'auto', LoRAs), checks.py (what is refused, and why),
runner.py (the parallel MODEL's plain side), status.py (the Status node), encoder_node.py (the Text
Encoder Loader); comfy_model.py and comfy_clip.py are the modules touching ComfyUI's model and text encoder
internals.

Display names live here, in one place. `comfy_model` (the parallel MODEL) is imported only when a node
runs inside ComfyUI.
"""

from .classes import (
    RocmParallelLoader,
    RocmParallelLoRA,
    RocmParallelModel,
    RocmParallelRingSampler,
    RocmParallelStatus,
    RocmParallelTPSampler,
)
from .encoder_node import RocmParallelTextEncoderLoader
from .vae_nodes import RocmParallelVAEDecode, RocmParallelVAEEncode

NODE_CLASS_MAPPINGS: dict[str, type] = {
    "RocmParallelLoader": RocmParallelLoader,
    "RocmParallelLoRA": RocmParallelLoRA,
    "RocmParallelModel": RocmParallelModel,
    "RocmParallelTPSampler": RocmParallelTPSampler,
    "RocmParallelRingSampler": RocmParallelRingSampler,
    "RocmParallelStatus": RocmParallelStatus,
    "RocmParallelVAEDecode": RocmParallelVAEDecode,
    "RocmParallelVAEEncode": RocmParallelVAEEncode,
    "RocmParallelTextEncoderLoader": RocmParallelTextEncoderLoader,
}
NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {
    "RocmParallelLoader": "ROCm Parallel Loader",
    "RocmParallelLoRA": "ROCm Parallel LoRA",
    "RocmParallelModel": "ROCm Parallel Model",
    "RocmParallelTPSampler": "TP Sampler",
    "RocmParallelRingSampler": "Ring Attention Sampler",
    "RocmParallelStatus": "ROCm Parallel Status",
    "RocmParallelVAEDecode": "ROCm Parallel VAE Decode",
    "RocmParallelVAEEncode": "ROCm Parallel VAE Encode",
    "RocmParallelTextEncoderLoader": "ROCm Parallel Text Encoder Loader",
}
