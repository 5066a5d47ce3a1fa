"""`plan`'s whole-graph table: the text encoder beside the diffusion model on the same GPUs. The encoders'
stored bytes (backend/plan/encoders.json) equal the meta model's, every released model names an encoder of
its own graph type, `plan` prices the placement exactly as `place_encoder` does on the meta model's bytes,
and the table's path imports no torch."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rocm_parallel.backend import cli
from rocm_parallel.backend.encoders.kind import get_encoder_kind
from rocm_parallel.backend.family import families
from rocm_parallel.backend.plan.encoder import COMFYUI_GPU0, encoder_bytes, place_encoder
from rocm_parallel.backend.plan.graph import ENCODERS_FILE, MODEL_ENCODERS, stored_encoders

sys.path.insert(0, str(Path(__file__).parent / "tools"))
from make_encoder_facts import encoders_facts, render

GB = 10**9
# ComfyUI's CLIPLoader type of each family's graph (what the Text Encoder Loader's `type` is set to)
CLIP_TYPES = {"flux1": "flux", "flux2": "flux2", "qwen_image": "qwen_image"}


def plan_json(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["plan", *argv, "--json"])
    return json.loads(out.getvalue())


def test_encoders_file_equals_the_meta_models_bytes() -> None:
    # data derived from code: a change to an encoder's model, TP plan or presets must rewrite it
    # (python tests/tools/make_encoder_facts.py), or plan would price the old encoder
    assert json.loads(ENCODERS_FILE.read_text()) == json.loads(render(encoders_facts()))


def test_every_released_model_names_an_encoder_of_its_graph() -> None:
    for family in families():
        if family.name not in CLIP_TYPES:  # Wan: its UMT5 is not one of the pack's encoders
            assert not set(family.presets) & set(MODEL_ENCODERS)
            continue
        for preset in family.presets:
            record = stored_encoders()[MODEL_ENCODERS[preset]]
            kind = get_encoder_kind(record["kind"])
            assert CLIP_TYPES[family.name] in kind.clip_types, f"{preset}: {kind.title}"


@pytest.mark.parametrize(
    ("model", "devices", "memory", "weights"),
    [
        ("flux2-dev", 4, 32, "fp8_e4m3fn"),
        ("qwen-image-edit-2511", 2, 32, "compute"),
        ("flux1-dev", 2, 24, "compute"),
    ],
)
def test_plan_places_the_encoder_as_the_meta_model_prices_it(
    model: str, devices: int, memory: int, weights: str
) -> None:
    answer = plan_json(
        "--model", model, "--devices", str(devices), "--memory-gb", str(memory), "--weight-dtype", weights
    )
    layout = next(e for e in answer["layouts"] if e["layout"] == answer["auto"]["layout"])
    kind = get_encoder_kind(stored_encoders()[MODEL_ENCODERS[model]]["kind"])
    held = "bfloat16" if weights == "compute" else "float8_e4m3fn"
    shard = encoder_bytes(kind, kind.presets[MODEL_ENCODERS[model]], devices, "vocab", held)
    expected = place_encoder(
        shard, round(layout["weights_gb"] * GB), round(layout["activations_gb"] * GB), memory * GB
    )
    got = answer["encoder"]
    assert got["tp"] == devices
    assert got["encoder_gb"] == pytest.approx(shard / GB, abs=1e-9)
    assert got["choice"] == expected.choice
    assert got["gpu0_peak_gb"] == pytest.approx(expected.gpu0_peak / GB, abs=1e-6)


def test_the_plan_prints_the_whole_graph_after_the_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    args = "plan --model flux2-dev --devices 4 --memory-gb 32 --weight-dtype fp8_e4m3fn".split()
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("Whole graph on the GPUs (text encoder + model + activations + ComfyUI on GPU 0):")
    assert lines[at + 2] == "| text encoder | encoder per GPU (GB) | GPU 0 at peak (GB) | choice |"
    assert lines[at + 4].startswith("| Mistral Small 3 24B (mistral3-24b, fp8) | 5.73 | ")
    assert lines[at + 4].endswith(" | resident |")
    assert lines[at + 5].startswith(
        "text encoder resident: encoder and model fit together (per GPU: encoder 5.73 GB"
    )
    assert cli.main([*args, "--full", "--encoder-dtype", "bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("Whole graph on the GPUs (text encoder + model + activations + ComfyUI on GPU 0):")
    assert lines[at + 2].startswith("| text encoder | tp | encoder per GPU (GB) | whole (GB) | model (GB) |")
    assert lines[at + 4].startswith("| Mistral Small 3 24B (mistral3-24b, bf16) | 4 | 11.45 | 45.80 | ")
    assert cli.main([*args, "--encoder", "none"]) == 0
    assert "Whole graph" not in capsys.readouterr().out


def test_an_encoder_that_does_not_split_over_the_gpus_is_left_to_comfyui() -> None:
    answer = plan_json(
        "--model", "flux2-dev", "--devices", "3", "--memory-gb", "32", "--weight-dtype", "fp8_e4m3fn"
    )
    got = answer["encoder"]
    assert (got["choice"], got["tp"], got["encoder_gb"]) == ("comfyui", 1, got["whole_gb"])
    assert got["reason"] == (
        "Mistral Small 3 24B cannot be split over 3 GPUs (its heads, key/value heads and MLP split over 2, 4 or "
        "8): ComfyUI's own CLIPLoader runs it"
    )


def test_gpu_0_at_peak_is_what_each_placement_holds_at_once() -> None:
    device = 24 * GB  # usable: 21.6 GB, of which ComfyUI's own 1.5 GB
    resident = place_encoder(encoder=6 * GB, model=6 * GB, activations=2 * GB, device=device)
    assert (resident.choice, resident.gpu0_peak) == ("resident", COMFYUI_GPU0 + 14 * GB)
    host = place_encoder(encoder=8 * GB, model=8 * GB, activations=5 * GB, device=device)
    assert (host.choice, host.gpu0_peak) == ("host", COMFYUI_GPU0 + 16 * GB)  # encoding: model + encoder
    # the model and its activations alone fill GPU 0 beside ComfyUI: nothing more goes there
    full = place_encoder(encoder=1 * GB, model=17 * GB, activations=3.5 * GB, device=device)
    assert full.choice == "comfyui"
    assert "alone fill GPU 0 past its usable memory" in full.reason
    assert full.gpu0_peak == COMFYUI_GPU0 + 20.5 * GB


def test_the_whole_graph_plan_imports_no_torch() -> None:
    # `plan` answers in seconds on 2 cores (issue 42): the encoders' bytes come from the file, not a torch model
    code = (
        "import sys\n"
        "from rocm_parallel.backend.plan.graph import plan_graph\n"
        "g = plan_graph('mistral3-24b', 'fp8', 4, 8e9, 0.5e9, 24)\n"
        "print(g.placement.choice, g.placement.encoder, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stderr == ""
    assert done.stdout.split() == ["resident", "5726883840", "False"]
