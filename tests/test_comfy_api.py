"""The import check (tests/comfy_uses.py): every ComfyUI name the pack imports, reads, calls, subclasses or
overrides holds in every ComfyUI version the comfy tier runs, as that real ComfyUI recorded it
(tests/data/comfy_api-<version>.json); a removed or changed name fails, naming the version and the place."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from comfy_uses import DATA, ROOT, check, main, problem, records, scan

VERSIONS = ("0.3.75", "0.33.0")  # the comfy tier's versions (docs/testing.md)


@pytest.fixture(scope="module")
def recorded() -> dict[str, dict[str, Any]]:
    return records()


def write_records(folder: Path, versions: dict[str, dict[str, Any]]) -> Path:
    for version, record in versions.items():
        (folder / f"comfy_api-{version}.json").write_text(json.dumps(record))
    return folder


def test_every_tier_version_is_recorded_from_its_commit(recorded):
    assert sorted(recorded) == sorted(VERSIONS)
    assert recorded["0.33.0"]["commit"].startswith("783545f6")  # yzkee/ComfyUI master, 2026-08-22
    assert recorded["0.3.75"]["commit"].startswith("9d8a8179")


def test_the_scan_sees_each_way_the_pack_reaches_comfyui():
    """A scanner that saw nothing would pass every version: the kinds of use it must find, each once."""
    uses = {(u.name, u.kind) for u in scan()}
    expected = {
        ("comfy.model_management.unload_all_models", "call"),  # import ... as mm; mm.x()
        ("comfy.samplers.KSampler.SAMPLERS", "attr"),  # import comfy.samplers; comfy.samplers.A.B
        ("folder_paths.get_full_path_or_raise", "call"),
        ("nodes.common_ksampler", "call"),  # ComfyUI's top-level nodes module
        ("comfy_extras.nodes_custom_sampler.SamplerCustom.sample", "call"),  # SamplerCustom().sample(...)
        ("server.PromptServer.instance", "attr"),  # sys.modules.get("server") and getattr(..., "x", None)
        ("comfyui_version.__version__", "attr"),  # importlib.import_module("comfyui_version")
        ("comfy.model_patcher.ModelPatcher", "subclass"),
        ("comfy.model_patcher.ModelPatcher.add_patches", "override"),
        ("comfy.patcher_extension.WrappersMP.OUTER_SAMPLE", "declared"),  # comfy_model._REQUIRED
        ("comfy.supported_models.FluxInpaint", "declared"),  # backend/flux/family.py config_class
        ("comfy.supported_models.QwenImage", "declared"),
    }
    assert expected <= uses, expected - uses
    assert all(u.where.split(":")[0] for u in scan())


def test_every_comfyui_name_the_pack_uses_holds_in_every_recorded_version(recorded):
    failed = [f.line() for f in check(scan(), recorded) if f.problem]
    assert failed == []


def test_the_command_writes_the_report_ci_keeps(tmp_path):
    report = tmp_path / "artifacts" / "comfy_api_check.txt"
    assert main(["--report", str(report)]) == 0
    text = report.read_text()
    assert text.startswith("ComfyUI names the pack uses, checked against 2 recorded version(s): 0.3.75")
    assert "ComfyUI 0.33.0  ok   nodes/comfy_model.py:" in text


def test_a_removed_name_fails_naming_the_version_and_the_place(recorded, tmp_path, capsys):
    """Mutation: `comfy.model_management.unload_all_models` recorded as gone from 0.33.0."""
    versions = copy.deepcopy(recorded)
    versions["0.33.0"]["names"]["comfy.model_management.unload_all_models"] = {"kind": "missing"}
    assert main(["--data", str(write_records(tmp_path, versions)), "--report", str(tmp_path / "r.txt")]) == 1
    failed = [line for line in capsys.readouterr().out.splitlines() if " FAIL " in line]
    line = next(
        n for n, text in enumerate(open(ROOT / "nodes/comfy_model.py"), 1) if "mm.unload_all_models()" in text
    )
    assert failed == [
        f"ComfyUI 0.33.0  FAIL nodes/comfy_model.py:{line}  call comfy.model_management.unload_all_models: "
        "missing in this ComfyUI"
    ]


def test_a_changed_signature_fails(recorded):
    """Mutation: ComfyUI's common_ksampler without the `denoise` keyword the pack passes."""
    names = copy.deepcopy(recorded["0.3.75"]["names"])
    entry = names["nodes.common_ksampler"]
    entry["params"] = [p for p in entry["params"] if p[0] != "denoise"]
    use = next(u for u in scan() if u.name == "nodes.common_ksampler" and u.kind == "call")
    assert "does not bind: got an unexpected keyword argument 'denoise'" in problem(use, names)
    assert problem(use, recorded["0.3.75"]["names"]) == ""


def test_an_override_that_no_longer_accepts_comfyuis_parameters_fails(recorded):
    names = copy.deepcopy(recorded["0.33.0"]["names"])
    names["comfy.model_patcher.ModelPatcher.add_patches"]["params"].append(
        ["extra", "POSITIONAL_OR_KEYWORD", True]
    )
    use = next(u for u in scan() if u.kind == "override" and u.name.endswith("ModelPatcher.add_patches"))
    assert problem(use, names) == (
        "the pack's override lacks parameter(s) extra that ComfyUI's own method has"
    )


def test_a_name_no_version_recorded_fails_until_recorded(recorded, tmp_path):
    source = tmp_path / "nodes" / "new.py"
    source.parent.mkdir()
    source.write_text(
        "def f():\n    import comfy.model_management as mm\n\n    return mm.get_free_memory()\n"
    )
    findings = [f for f in check(scan([source], root=tmp_path), recorded) if f.problem]
    assert {(f.version, f.use.name, f.use.where) for f in findings} == {
        (v, "comfy.model_management.get_free_memory", "nodes/new.py:4") for v in VERSIONS
    }
    assert all(f.problem.startswith("not recorded for this version") for f in findings)


def test_records_are_in_the_data_folder():
    assert sorted(p.name for p in DATA.glob("comfy_api-*.json")) == [f"comfy_api-{v}.json" for v in VERSIONS]


def test_a_guarded_shim_may_be_absent_from_a_version_but_not_from_all(recorded):
    """comfy_beside.dynamic_vram reads comfy.memory_management inside `try: ... except ImportError`: 0.3.75
    lacks it (fine), a name that no version has is a typo."""
    use = next(u for u in scan() if u.name == "comfy.memory_management.aimdo_enabled")
    assert use.guarded
    by_version = {f.version: f for f in check([use], recorded)}
    assert by_version["0.3.75"].absent and not by_version["0.3.75"].problem
    assert not by_version["0.33.0"].absent
    gone = copy.deepcopy(recorded)
    gone["0.33.0"]["names"][use.name] = {"kind": "missing"}
    assert {f.problem for f in check([use], gone)} == {
        "missing in every recorded version (0.3.75, 0.33.0), though guarded"
    }
    unguarded = next(u for u in scan() if u.name == "comfy.model_management.free_memory")
    assert not unguarded.guarded


def test_a_getattr_with_a_default_is_a_shim_and_one_without_is_not(recorded):
    """nodes/comfy_clip.py reads comfy.utils.convert_old_quants by `getattr(..., None)` and skips the conversion
    where ComfyUI has none (0.3.75): a handled absence, not a failure; `getattr(mod, "x")` alone is a plain use."""
    use = next(u for u in scan() if u.name == "comfy.utils.convert_old_quants")
    assert use.guarded
    by_version = {f.version: f for f in check([use], recorded)}
    assert by_version["0.3.75"].absent and not by_version["0.3.75"].problem
    assert not by_version["0.33.0"].absent
    plain = dataclasses.replace(use, guarded=False)
    assert {f.problem for f in check([plain], recorded)} == {"", "missing in this ComfyUI"}
