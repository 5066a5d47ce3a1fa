"""The planner's stored model facts: facts.json equals the meta model's facts for every preset, and `plan`
answers from it without importing diffusers."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rocm_parallel.backend.config import ParallelLayout
from rocm_parallel.backend.family import families
from rocm_parallel.backend.plan import model_facts
from rocm_parallel.backend.plan.facts import FACTS_FILE, ModelFacts, decode, encode, stored, stored_facts
from rocm_parallel.backend.plan.shapes import meta_model_facts, weight_bytes
from rocm_parallel.testing.models import tiny_flux_config

sys.path.insert(0, str(Path(__file__).parent / "tools"))
from make_plan_facts import presets_facts, render


@pytest.mark.slow
def test_facts_file_equals_the_meta_models_facts() -> None:
    # The file is data derived from code: a change to a family's model, TP plan or presets must rewrite it
    # (python tests/tools/make_plan_facts.py), or plan would price the old model.
    assert json.loads(FACTS_FILE.read_text()) == json.loads(render(presets_facts()))


def test_every_preset_is_stored() -> None:
    for family in families():
        for preset, config in family.presets.items():
            assert preset in stored()[family.name], f"{family.name} {preset} is not in facts.json"
            assert stored_facts(family, family.dims(config)) is not None


def test_a_record_decodes_to_the_facts_it_encodes() -> None:
    family = next(f for f in families() if f.name == "flux1")
    dims = family.dims(tiny_flux_config())
    facts = meta_model_facts("flux1", dims)
    decoded = decode(json.loads(json.dumps(encode(facts, dims))))
    # The file groups a repeated block's parameters, so they come back grouped: the same set, in another order.
    assert by_name(decoded) == by_name(facts)
    assert dataclasses.replace(decoded, parameters=()) == dataclasses.replace(facts, parameters=())


def by_name(facts: ModelFacts) -> dict[str, tuple]:
    named = {name: (shape, split, fp32) for name, shape, split, fp32 in facts.parameters}
    assert len(named) == len(facts.parameters)
    return named


@pytest.mark.torch_api
def test_dims_of_no_preset_come_from_the_meta_model() -> None:
    family = next(f for f in families() if f.name == "flux1")
    dims = family.dims(tiny_flux_config())
    assert stored_facts(family, dims) is None
    assert model_facts("flux1", dims) == meta_model_facts("flux1", dims)


def test_plan_does_not_import_diffusers() -> None:
    # Importing diffusers (and torch's compiler with it) took plan 40-68 s on a busy 2-core machine.
    code = (
        "import sys\n"
        "from rocm_parallel.backend.cli import main\n"
        "rc = main(['plan', '--model', 'flux2-dev', '--devices', '4', '--memory-gb', '16'])\n"
        "print('rc', rc, 'diffusers' in sys.modules)\n"
    )
    out = fresh_python(code)
    assert out.splitlines()[-1] == "rc 1 False", out[-2000:]


def fresh_python(code: str) -> str:
    """The stdout of `code` run in a new interpreter (nothing this session imported), which writes no stderr."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stderr == ""
    return done.stdout


def test_stored_facts_decode_and_shard_without_torch() -> None:
    # `plan` reads facts.json and prices a rank's shard; importing torch for the split kinds and `shard_pieces`
    # cost it ~2 s of CPU on a 2-core machine (issue 42). A fresh process decodes every stored record and sums
    # rank 0's tp-2 shard in bf16 (float32 where the model keeps it) with nothing but splits.py; the sums must
    # be the planner's own `weight_bytes`, and torch must not have been imported.
    code = (
        "import json, math, sys\n"
        "from rocm_parallel.backend.config import ModelDims\n"
        "from rocm_parallel.backend.parallel.splits import shard_pieces\n"
        "from rocm_parallel.backend.plan.facts import decode, stored\n"
        "held = {}\n"
        "for family, records in stored().items():\n"
        "    for preset, record in records.items():\n"
        "        dims = ModelDims(**{k: record['dims'][k] for k in ('heads', 'head_dim', 'mlp', 'text_dim', "
        "'token_channels')})\n"
        "        total = 0\n"
        "        for name, shape, split, fp32 in decode(record).parameters:\n"
        "            pieces = None if split is None else shard_pieces(split, name.rpartition('.')[2], shape, 0, 2, "
        "dims)\n"
        "            total += (4 if fp32 else 2) * math.prod(shape if pieces is None else pieces.shape(shape))\n"
        "        held[f'{family}/{preset}'] = total\n"
        "print(json.dumps({'held': held, 'torch': 'torch' in sys.modules}))\n"
    )
    result = json.loads(fresh_python(code))
    assert result["torch"] is False
    expected = {
        f"{family.name}/{preset}": weight_bytes(
            family.dims(config), ParallelLayout(tp=2), 2, family=family.name
        )
        for family in families()
        for preset, config in family.presets.items()
        if preset in stored().get(family.name, {})
    }
    assert result["held"] == expected
    assert len(expected) == sum(len(records) for records in stored().values())
