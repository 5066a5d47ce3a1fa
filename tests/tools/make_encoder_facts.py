"""Write backend/plan/encoders.json: the bytes one rank holds of every text encoder preset, from the meta model.

    python tests/tools/make_encoder_facts.py         # rewrites backend/plan/encoders.json

Run it after changing an encoder kind's presets, model or TP plan; tests/test_encoder_facts.py fails until
the file equals what `encoder_bytes` (the encoder built on the meta device) gives. `plan` reads the file so
that it imports no torch (backend/plan/graph.py).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.encoders.kind import encoder_kinds
from rocm_parallel.backend.plan.encoder import encoder_bytes
from rocm_parallel.backend.plan.graph import ENCODER_DTYPES, ENCODER_TABLES, ENCODERS_FILE, MAX_DEGREE


def encoders_facts() -> dict[str, dict[str, Any]]:
    """encoder preset -> its kind, title and, per tensor-parallel degree it splits over (1..MAX_DEGREE), rank
    0's parameter bytes per held dtype (token table split by vocabulary, as the loader node holds it)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted(encoder_kinds(), key=lambda k: k.name):
        for preset, config in kind.presets.items():
            per_degree: dict[str, dict[str, int]] = {}
            for degree in range(1, MAX_DEGREE + 1):
                try:
                    kind.validate_tp(degree, config)
                except ConfigError:
                    continue
                per_degree[str(degree)] = {
                    dtype: encoder_bytes(kind, config, degree, "vocab", dtype, ENCODER_TABLES.get(short))
                    for short, dtype in ENCODER_DTYPES.items()
                }
            out[preset] = {"kind": kind.name, "title": kind.title, "bytes": per_degree}
    return out


def render(facts: dict[str, dict[str, Any]]) -> str:
    return json.dumps(facts, indent=1) + "\n"


def main() -> int:
    ENCODERS_FILE.write_text(render(encoders_facts()))
    print(f"wrote {ENCODERS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
