"""ComfyUI node classes: thin wrappers over `logic` (plain Python) and, through it, the backend.

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

NODE_CLASS_MAPPINGS: dict[str, type] = {
    "RocmParallelLoader": RocmParallelLoader,
    "RocmParallelLoRA": RocmParallelLoRA,
    "RocmParallelModel": RocmParallelModel,
    "RocmParallelTPSampler": RocmParallelTPSampler,
    "RocmParallelRingSampler": RocmParallelRingSampler,
    "RocmParallelStatus": RocmParallelStatus,
}
NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {
    "RocmParallelLoader": "ROCm Parallel Loader",
    "RocmParallelLoRA": "ROCm Parallel LoRA",
    "RocmParallelModel": "ROCm Parallel Model",
    "RocmParallelTPSampler": "TP Sampler",
    "RocmParallelRingSampler": "Ring Attention Sampler",
    "RocmParallelStatus": "ROCm Parallel Status",
}
