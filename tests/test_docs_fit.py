"""The "will it fit" tables (README's summary, docs/layouts.md's rows) are what `plan` answers: each row is
run through the CLI (`plan --json`) and its cells compared, so a planner change that moves a model in or out
of a card size fails here until the tables say so."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
from pathlib import Path

import pytest

from rocm_parallel.backend import cli

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "FLUX.1-dev": "flux1-dev",
    "FLUX.2 [dev]": "flux2-dev",
    "Qwen-Image": "qwen-image",
    "Qwen-Image-Edit": "qwen-image-edit",
}
# Qwen-Image's template's cfg (for the Edit model too); FLUX.1-dev and FLUX.2 [dev] run at cfg 1
CFG = {"qwen-image": 2.5, "qwen-image-edit": 2.5}
REFERENCES = {"qwen-image-edit": 1}  # its input image, at the output's size
GPUS = re.compile(r"^(\d+) × (\d+) GB$")


def _table(path: Path, marker: str) -> list[list[str]]:
    """The cells of the Markdown table right after `<!-- marker -->` (header and rule dropped)."""
    lines = path.read_text().split(f"<!-- {marker} -->\n", 1)[1].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    assert rows, f"no table after <!-- {marker} --> in {path.name}"
    return rows


@functools.cache
def _auto(model: str, devices: int, memory_gb: int, weight_dtype: str) -> str:
    """`plan`'s answer as the tables write it: 'tp 2, 12.2 GB' (auto's layout, its memory per GPU) or 'no'."""
    args = ["plan", "--model", model, "--devices", str(devices), "--memory-gb", str(memory_gb)]
    args += ["--cfg", str(CFG.get(model, 1.0)), "--weight-dtype", weight_dtype, "--json"]
    args += ["--references", str(REFERENCES.get(model, 0))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(args)
    answer = json.loads(out.getvalue())
    layout = answer["answer"]["layout"]  # the screen's one answer: the whole graph's, with its text encoder
    if layout is None:
        return "no"
    per_gpu = next(e["per_gpu_gb"] for e in answer["layouts"] if e["layout"] == layout)
    return f"{layout}, {per_gpu:.1f} GB"


def _gpus(cell: str) -> tuple[int, int]:
    match = GPUS.match(cell)
    assert match, f"{cell!r} is not 'N × G GB'"
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize("row", _table(ROOT / "docs" / "layouts.md", "fit-table"), ids=" ".join)
def test_each_row_of_the_fit_table_is_what_plan_answers(row: list[str]) -> None:
    name, gpus, bf16, fp8 = row
    devices, memory = _gpus(gpus)
    assert [_auto(MODELS[name], devices, memory, w) for w in ("compute", "fp8_e4m3fn")] == [bf16, fp8]


def test_the_readme_summary_is_what_plan_answers() -> None:
    readme = ROOT / "README.md"
    header = readme.read_text().split("<!-- fit-summary -->\n", 1)[1].splitlines()[0]
    columns = [_gpus(c.strip()) for c in header.strip("|").split("|")[1:]]
    for name, *cells in _table(readme, "fit-summary"):
        for (devices, memory), cell in zip(columns, cells, strict=True):
            bf16, fp8 = (_auto(MODELS[name], devices, memory, w) for w in ("compute", "fp8_e4m3fn"))
            lightest = "bf16" if bf16 != "no" else "fp8" if fp8 != "no" else "no"
            assert cell == lightest, f"README: {name} on {devices} x {memory} GB"


WAN_ROW = re.compile(
    r"`wan2_1_t2v_14b_parallel_model_batch2_ulysses2` .* on `(?P<layout>[^`]+)`, the planner's pick for "
    r"(?P<memory>\d+) GB GPUs \(`plan (?P<args>[^`]+)`\): .*?, (?P<weights>[\d.]+) GB of weights per GPU"
)


def test_the_wan_workflows_layout_is_what_plan_answers_for_its_video() -> None:
    """docs/nodes.md's Wan 2.1 workflow (1280x720 x 81 frames) names its layout as the planner's pick with the
    command that prices it: `plan --frames` prices every frame (75,600 image tokens; without it, one frame's
    3,600) and answers that layout with those weights."""
    found = WAN_ROW.search((ROOT / "docs" / "nodes.md").read_text())
    assert found, "docs/nodes.md: the Wan 2.1 workflow's row names no planner pick"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["plan", *found["args"].split(), "--json"]) == 0
    answer = json.loads(out.getvalue())
    assert answer["tokens"]["image"] == 21 * (720 // 16) * (1280 // 16) == 75_600
    assert answer["setup"]["memory_gb"] == float(found["memory"])
    assert answer["answer"]["layout"] == found["layout"]
    chosen = next(e for e in answer["layouts"] if e["layout"] == found["layout"])
    assert f"{chosen['weights_gb']:.1f}" == found["weights"]
