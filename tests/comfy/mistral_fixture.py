"""A small FLUX.2 [dev] text encoder as ComfyUI reads it: Mistral Small 3's pruned variant with its tokenizer.

ComfyUI (comfy/sd.py `detect_te_model`) takes a language model whose `post_attention_layernorm` has 5120 rows
for Mistral Small 3 and, without layer 39, for its FLUX.2 pruned variant (`flux2_te(pruned=True)`: 30 layers,
no final norm, layers 10, 20 and 30 stacked as FLUX.2's text). So the file keeps the width and the 30 layers
and is small everywhere else: 4 attention heads and 4 key/value heads (TP 4 divides both) of Mistral's fixed
head_dim 128, an MLP of 32, a vocabulary of 1024. Its weights are stored in bfloat16 (ComfyUI computes in
float32 from them either way; the file is ~0.7 GB instead of 1.3). It keeps a final norm's weight that
ComfyUI's pruned variant does not read, as a file cut from the 40-layer model may.

The tokenizer travels in the file as ComfyUI's loader expects Mistral's: a `tekken_model` uint8 tensor holding
a tekken JSON (comfy/text_encoders/bpe_tokenizer.py `from_tekken_json`). The one built here is small but in
Mistral's format: the 256 single bytes first, then byte pairs grown into whole words of FLUX.2's system prompt
and the tests' prompts (so ComfyUI's BPE merges them, as a real vocabulary would), and Mistral's special tokens
at their own ranks (<s> 1, [INST] 3, <pad> 11, [SYSTEM_PROMPT] 17: the ids ComfyUI's Mistral tokenizer and
FLUX.2's template use).
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

# Mistral's tekken special tokens, rank = position (Mistral Small 3.1's tekken.json; <SPECIAL_n> fill the rest)
SPECIALS = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
]  # fmt: skip
NUM_SPECIALS = 32  # specials 20-31 are <SPECIAL_n>, as Mistral pads its 1000
VOCAB_SIZE = 1024
# the pre-tokenizer ComfyUI splits tekken text with (bpe_tokenizer.py _LLAMA_PATTERN), which the words follow
PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
# FLUX.2's system prompt (comfy/text_encoders/flux.py Flux2Tokenizer.llama_template)
SYSTEM_PROMPT = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)

# ComfyUI's Mistral3Small24BConfig fields the file changes (the rest, head_dim 128 included, are ComfyUI's)
MISTRAL3_PRUNED = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 5120, "intermediate_size": 32, "num_hidden_layers": 30,
    "num_attention_heads": 4, "num_key_value_heads": 4,
}  # fmt: skip


def _words(text: str) -> list[bytes]:
    """Pieces as the pre-tokenizer roughly cuts them (a space joins the word after it), as bytes."""
    return [w.encode() for w in re.findall(r" ?[A-Za-z]+| ?[^\sA-Za-z]+|\s+", text)]


def tekken_json(texts: list[str]) -> bytes:
    """A tekken JSON whose merges grow every word of `texts` from its bytes, one byte at a time."""
    ranks: list[bytes] = [bytes([b]) for b in range(256)]
    known = set(ranks)
    for word in (w for t in texts for w in _words(t)):
        for end in range(2, len(word) + 1):
            if word[:end] not in known and len(ranks) < VOCAB_SIZE - NUM_SPECIALS:
                known.add(word[:end])
                ranks.append(word[:end])
    specials = SPECIALS + [f"<SPECIAL_{i}>" for i in range(len(SPECIALS), NUM_SPECIALS)]
    return json.dumps(
        {
            "config": {
                "pattern": PATTERN,
                "num_vocab_tokens": len(ranks),
                "default_vocab_size": VOCAB_SIZE,
                "default_num_special_tokens": NUM_SPECIALS,
                "version": "v7",
            },
            "vocab": [
                {"rank": r, "token_bytes": base64.b64encode(b).decode(), "token_str": b.decode("latin-1")}
                for r, b in enumerate(ranks)
            ],
            "special_tokens": [
                {"rank": r, "token_str": s, "is_control": True} for r, s in enumerate(specials)
            ],
        }
    ).encode()


def save_pruned_mistral(comfy: Any, path: Path, texts: list[str], seed: int) -> Path:
    """ComfyUI's own Mistral3Small24B in its pruned FLUX.2 config (built on the meta device, seeded random
    weights of a sane scale in bfloat16), saved with the tekken tokenizer as ComfyUI's file keys it."""
    llama = comfy.text_encoders.llama
    config = {**MISTRAL3_PRUNED, "final_norm": False}  # flux2_te(pruned=True): fewer than 40 layers, no norm
    model = llama.Mistral3Small24B(config, torch.bfloat16, "meta", comfy.ops.manual_cast)
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if "norm" in name:
            x = 1 + 0.1 * torch.randn(value.shape, generator=g)
        elif "embed" in name:
            x = torch.randn(value.shape, generator=g)
        else:
            x = torch.randn(value.shape, generator=g) / value.shape[1] ** 0.5
            if name.endswith(("o_proj.weight", "down_proj.weight")):  # GPT-2's residual scaling: 30 layers
                x = x / (2 * config["num_hidden_layers"]) ** 0.5  # add to a stream of the embeddings' scale
        sd[name] = x.to(torch.bfloat16)
    # the 40-layer model's final norm, as a file pruned from it may keep: ComfyUI builds none for it and leaves
    # it unread (the pack must do the same: backend/encoders/llama/kind.py _mistral3_from_shapes)
    sd["model.norm.weight"] = (1 + 0.1 * torch.randn(config["hidden_size"], generator=g)).to(torch.bfloat16)
    sd["tekken_model"] = torch.from_numpy(
        np.frombuffer(bytearray(tekken_json([SYSTEM_PROMPT, *texts])), dtype=np.uint8)
    )
    save_file(sd, str(path))
    return path
