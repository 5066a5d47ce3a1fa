"""Check ComfyUI workflows (UI format and API format) against node specs in /object_info's shape.

The specs come from the pack's own node classes (`pack_object_info`) plus either the core nodes of each
ComfyUI version the pack is checked against, as that version's live /object_info reported them
(tests/data/comfy_core_nodes*.json, `core_object_info(version)`, written by tests/tools/dump_core_nodes.py;
the CI tier checks every workflow against every version), or a live ComfyUI's /object_info (tests/comfy,
which also checks its version's file against it). Versions differ (0.33 offers more samplers, SaveImage and
SaveLatent gained outputs), so no one list stands for all.
Every check returns a list of error strings, empty when the workflow is valid.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
CORE_NODES = DATA / "comfy_core_nodes.json"  # ComfyUI 0.3.75's, the oldest the pack claims
BASE_VERSION = "0.3.75"
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
# Inputs whose choices are the user's own model files: any file name is valid in a shared workflow.
MODEL_FILE_INPUTS = {
    ("DualCLIPLoader", "clip_name1"),
    ("DualCLIPLoader", "clip_name2"),
    ("CLIPLoader", "clip_name"),
    ("VAELoader", "vae_name"),
    ("RocmParallelLoader", "checkpoint"),
    ("RocmParallelLoRA", "lora_name"),
    ("RocmParallelVAEDecode", "vae_name"),
    ("RocmParallelVAEEncode", "vae_name"),
    ("RocmParallelTextEncoderLoader", "clip_name1"),
    ("RocmParallelTextEncoderLoader", "clip_name2"),
    ("LoadImage", "image"),  # a file in the user's ComfyUI/input folder
    ("UNETLoader", "unet_name"),
    ("LoraLoaderModelOnly", "lora_name"),
}


def core_nodes_file(version: str) -> Path:
    """Where ComfyUI `version`'s core node specs live (the naming of make_comfy_references.reference_file)."""
    return CORE_NODES if version == BASE_VERSION else DATA / f"comfy_core_nodes-{version}.json"


def core_versions() -> list[str]:
    """The ComfyUI versions whose core node specs are recorded, oldest first."""
    found = [BASE_VERSION] + [
        p.stem.removeprefix("comfy_core_nodes-") for p in DATA.glob("comfy_core_nodes-*.json")
    ]
    return sorted(set(found), key=lambda v: tuple(int(x) for x in v.split(".")))


def core_object_info(version: str = BASE_VERSION) -> dict[str, Any]:
    """ComfyUI `version`'s core node specs, as its /object_info reported them."""
    data = json.loads(core_nodes_file(version).read_text())
    source = data.pop("_source")
    if not source.startswith(f"ComfyUI {version},"):
        raise ValueError(
            f"{core_nodes_file(version)} was written by {source.split(',')[0]}, not ComfyUI {version}"
        )
    return data


def pack_object_info(mappings: dict[str, type]) -> dict[str, Any]:
    """What ComfyUI's /object_info reports for V1 nodes: INPUT_TYPES and RETURN_TYPES."""
    return {
        name: {"input": cls.INPUT_TYPES(), "output": list(cls.RETURN_TYPES)} for name, cls in mappings.items()
    }


def input_kind(spec: Any) -> tuple[str, dict[str, Any]]:
    """('COMBO', {'options': [...]}) or (type, options) from one /object_info input spec."""
    head = spec[0]
    options = dict(spec[1]) if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if isinstance(head, list):  # V1 combo: the choices themselves
        return "COMBO", {**options, "options": head}
    return head, options


def inputs_of(info: dict[str, Any], class_type: str) -> dict[str, tuple[str, dict[str, Any], bool]]:
    """name -> (type, options, required), in widget order (required first)."""
    spec = info[class_type]["input"]
    out = {}
    for section in ("required", "optional"):
        for name, value in spec.get(section, {}).items():
            kind, options = input_kind(value)
            out[name] = (kind, options, section == "required")
    return out


def is_widget(kind: str) -> bool:
    return kind in WIDGET_TYPES or kind == "COMBO"


def check_layout(value: Any) -> str | None:
    """The ROCm Parallel Model's layout field: a word it knows or degrees the pack's own parser reads
    ('batch 2 x tp 2'); the parser's message otherwise."""
    from rocm_parallel.backend.config import ConfigError, ParallelLayout
    from rocm_parallel.nodes.inputs import MODEL_LAYOUTS

    if isinstance(value, str) and value.strip().lower() in MODEL_LAYOUTS:
        return None
    try:
        ParallelLayout.parse(value)
    except ConfigError as exc:
        return str(exc)
    return None


# Pack inputs whose text has a syntax of its own: (class, input) -> the check.
TEXT_SYNTAX = {("RocmParallelModel", "layout"): check_layout}


def check_value(class_type: str, name: str, kind: str, options: dict[str, Any], value: Any) -> str | None:
    where = f"{class_type}.{name}={value!r}"
    syntax = TEXT_SYNTAX.get((class_type, name))
    if syntax is not None and (err := syntax(value)) is not None:
        return f"{where}: {err}"
    if kind == "COMBO":
        if (class_type, name) in MODEL_FILE_INPUTS:
            return None if isinstance(value, str) and value else f"{where}: not a file name"
        return None if value in options["options"] else f"{where}: not one of {options['options']}"
    if kind == "INT" and (not isinstance(value, int) or isinstance(value, bool)):
        return f"{where}: not an INT"
    if kind == "FLOAT" and not isinstance(value, (int, float)):
        return f"{where}: not a FLOAT"
    if kind == "STRING" and not isinstance(value, str):
        return f"{where}: not a STRING"
    if kind in ("INT", "FLOAT"):
        if ("min" in options and value < options["min"]) or ("max" in options and value > options["max"]):
            return f"{where}: outside [{options.get('min')}, {options.get('max')}]"
    return None


def _unknown(info: dict[str, Any], class_type: str) -> str | None:
    return (
        None
        if class_type in info
        else f"node type {class_type!r} is neither a pack node nor a known core node"
    )


def check_api(prompt: dict[str, Any], info: dict[str, Any]) -> list[str]:
    """An API-format prompt, as POST /prompt takes it."""
    errors = []
    for node_id, node in prompt.items():
        class_type = node["class_type"]
        if (err := _unknown(info, class_type)) is not None:
            errors.append(err)
            continue
        spec = inputs_of(info, class_type)
        given = node["inputs"]
        errors += [f"node {node_id} {class_type}: unknown input {k!r}" for k in given if k not in spec]
        for name, (kind, options, required) in spec.items():
            if name not in given:
                if required:
                    errors.append(f"node {node_id} {class_type}: required input {name!r} missing")
                continue
            value = given[name]
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                source = prompt.get(value[0])
                if source is None:
                    errors.append(f"node {node_id} {class_type}.{name} links to missing node {value[0]}")
                    continue
                outputs = info[source["class_type"]]["output"]
                if value[1] >= len(outputs) or outputs[value[1]] != kind:
                    got = outputs[value[1]] if value[1] < len(outputs) else "nothing"
                    errors.append(f"node {node_id} {class_type}.{name} takes {kind}, linked to {got}")
            elif not is_widget(kind):
                errors.append(f"node {node_id} {class_type}.{name} takes {kind} and must be linked")
            elif (err := check_value(class_type, name, kind, options, value)) is not None:
                errors.append(f"node {node_id} {err}")
    return errors


def widget_names(spec: dict[str, tuple[str, dict[str, Any], bool]], linked: set[str]) -> list[str]:
    """The order of a UI node's widgets_values; a seed-like INT has a 'control after generate' value next,
    and an image input with `image_upload` (LoadImage) the frontend's upload button ('image')."""
    names = []
    for name, (kind, options, _) in spec.items():
        if is_widget(kind) and name not in linked:
            names.append(name)
            if options.get("control_after_generate"):
                names.append(f"{name}:control_after_generate")
            if options.get("image_upload"):
                names.append(f"{name}:upload")
    return names


def check_ui(workflow: dict[str, Any], info: dict[str, Any]) -> list[str]:
    """A UI-format workflow, as people drag it in: nodes, links table, widget values."""
    errors = []
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {link[0]: link for link in workflow["links"]}
    for node in workflow["nodes"]:
        class_type, nid = node["type"], node["id"]
        if (err := _unknown(info, class_type)) is not None:
            errors.append(err)
            continue
        spec = inputs_of(info, class_type)
        linked = set()
        for slot, socket in enumerate(node.get("inputs", [])):
            name = socket["name"]
            if name not in spec:
                errors.append(f"node {nid} {class_type}: unknown input {name!r}")
                continue
            kind = spec[name][0]
            if socket["type"] != kind:
                errors.append(
                    f"node {nid} {class_type}.{name} is typed {socket['type']}, the node takes {kind}"
                )
            if socket.get("link") is None:
                continue
            link = links.get(socket["link"])
            if link is None:
                errors.append(
                    f"node {nid} {class_type}.{name}: link {socket['link']} is not in the links table"
                )
                continue
            linked.add(name)
            _, src, src_slot, dst, dst_slot, link_type = link
            source = nodes.get(src)
            out_types = info[source["type"]]["output"] if source and source["type"] in info else []
            if (dst, dst_slot) != (nid, slot):
                errors.append(
                    f"link {link[0]} ends at node {dst} slot {dst_slot}, not node {nid} slot {slot}"
                )
            if (
                source is None
                or src_slot >= len(out_types)
                or out_types[src_slot] != kind
                or link_type != kind
            ):
                errors.append(
                    f"link {link[0]} into {class_type}.{name} ({kind}) comes from a {link_type} output"
                )
            elif link[0] not in source["outputs"][src_slot]["links"]:
                errors.append(f"link {link[0]} is missing from node {src}'s output {src_slot} links")
        missing = [n for n, (k, _, req) in spec.items() if req and not is_widget(k) and n not in linked]
        errors += [f"node {nid} {class_type}: required input {n!r} is not connected" for n in missing]
        names = widget_names(spec, linked)
        values = node.get("widgets_values", [])
        if len(values) != len(names):
            errors.append(f"node {nid} {class_type}: {len(values)} widget values for widgets {names}")
            continue
        for name, value in zip(names, values, strict=True):
            if name.endswith(":control_after_generate"):
                if value not in ("fixed", "increment", "decrement", "randomize"):
                    errors.append(f"node {nid} {class_type}.{name}={value!r}")
                continue
            if name.endswith(":upload"):
                if value != "image":
                    errors.append(f"node {nid} {class_type}.{name}={value!r}")
                continue
            kind, options, _ = spec[name]
            if (err := check_value(class_type, name, kind, options, value)) is not None:
                errors.append(f"node {nid} {err}")
    for link in workflow["links"]:
        if link[3] not in nodes or link[1] not in nodes:
            errors.append(f"link {link[0]} joins a node that does not exist")
    return errors


def ui_to_api(workflow: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """The API prompt a UI workflow stands for (what the frontend queues), for comparing the two files."""
    links = {link[0]: link for link in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        spec = inputs_of(info, node["type"])
        inputs: dict[str, Any] = {}
        linked = {s["name"] for s in node.get("inputs", []) if s.get("link") is not None}
        names = widget_names(spec, linked)
        for name, value in zip(names, node.get("widgets_values", []), strict=True):
            if ":" not in name:
                inputs[name] = value
        for socket in node.get("inputs", []):
            if socket.get("link") is not None:
                link = links[socket["link"]]
                inputs[socket["name"]] = [str(link[1]), link[2]]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


TITLE_HEIGHT = 30  # LiteGraph draws a node's title bar above its `pos`


def overlapping_nodes(workflow: dict[str, Any], gap: int = 10) -> list[str]:
    """Pairs of nodes whose boxes (title bar included, `gap` pixels apart at least) overlap on the canvas."""
    boxes = []
    for node in workflow["nodes"]:
        (x, y), (w, h) = node["pos"], node["size"]
        boxes.append((f"{node['id']} {node['type']}", x, y - TITLE_HEIGHT, x + w, y + h))
    found = []
    for i, (name_a, ax0, ay0, ax1, ay1) in enumerate(boxes):
        for name_b, bx0, by0, bx1, by1 in boxes[i + 1 :]:
            if ax0 < bx1 + gap and bx0 < ax1 + gap and ay0 < by1 + gap and by0 < ay1 + gap:
                found.append(f"{name_a} overlaps {name_b}")
    return found
