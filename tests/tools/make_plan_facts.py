"""Write backend/plan/facts.json: the planner's model facts of every family preset, from the meta model.

    python tests/tools/make_plan_facts.py            # rewrites backend/plan/facts.json

Run it after changing a family's presets, model or TP plan; tests/test_plan_facts.py fails until the file
equals what the meta model gives (it builds each preset's diffusers model on the meta device, which is
what `plan` avoids by reading this file).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rocm_parallel.backend.family import families
from rocm_parallel.backend.plan.facts import FACTS_FILE, encode
from rocm_parallel.backend.plan.shapes import meta_model_facts


def presets_facts() -> dict[str, dict[str, Any]]:
    """family name -> preset name -> its facts as facts.json stores them, from the meta model."""
    out: dict[str, dict[str, Any]] = {}
    for family in sorted(families(), key=lambda f: f.name):
        for preset, config in family.presets.items():
            dims = family.dims(config)
            out.setdefault(family.name, {})[preset] = encode(meta_model_facts(family.name, dims), dims)
    return out


def render(facts: dict[str, dict[str, Any]]) -> str:
    """The JSON text, one parameter entry per line (a reviewer reads a plan change as a few changed lines)."""
    lines: dict[str, str] = {}
    for records in facts.values():
        for record in records.values():
            for i, entry in enumerate(record["parameters"]):
                token = f"@{len(lines)}@"
                lines[token] = json.dumps(entry)
                record["parameters"][i] = token
    text = json.dumps(facts, indent=1)
    for token, line in lines.items():
        text = text.replace(f'"{token}"', line, 1)
    return text + "\n"


def main() -> int:
    FACTS_FILE.write_text(render(presets_facts()))
    print(f"wrote {FACTS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
