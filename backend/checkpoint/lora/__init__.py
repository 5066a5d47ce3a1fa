"""FLUX LoRAs on a sharded model, computed as ComfyUI's LoraLoaderModelOnly computes them.

Adapter kinds (one module each, comfy/weight_adapter/ in ComfyUI 0.3.75 and 0.33): LoRA (plain.py), LoHa
(loha.py), LoKr (lokr.py), each optionally DoRA-decomposed (dora.py), and full weight / bias differences
(`.diff`, `.diff_b`: diff.py). What ComfyUI applies and this does not is refused by name (kinds.py says
why). Key formats: names.py.

* `inspect_lora` (parse.py): what a file patches in a checkpoint, from its header; the caller and every
  worker run it.
* `check_loras` (values.py): the caller's check before any worker starts: headers, and every value (no
  NaN/inf, no overflow at the requested strength).
* `apply_loras` (apply.py): what a worker runs: each rank re-reads and patches its own shard.
"""

from .apply import apply_loras
from .kinds import KINDS
from .names import LOOKED_FOR, slot_table, split_key
from .parse import inspect_lora
from .plain import FACTOR_SUFFIXES
from .records import LoraError, LoraInfo, LoraModule, LoraTarget
from .values import LIMIT, check_loras, scan_values

__all__ = [
    "FACTOR_SUFFIXES",
    "KINDS",
    "LIMIT",
    "LOOKED_FOR",
    "LoraError",
    "LoraInfo",
    "LoraModule",
    "LoraTarget",
    "apply_loras",
    "check_loras",
    "inspect_lora",
    "scan_values",
    "slot_table",
    "split_key",
]
