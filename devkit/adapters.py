"""LoRA adapters of the generated tiny model (scripts/make_tiny_model.py), made in memory in
PEFT's layout: what the tests upload, validate and serve, and what bench/lora.py loads."""

from __future__ import annotations

import json
import struct
from array import array
from typing import Any

from adapters.validation import Architecture
from devkit.tiny_model import VERSION

# The generated tiny-chat model (scripts/make_tiny_model.py): hidden 128, 2 heads of 64,
# 2 layers, MLP 256.
TINY_CONFIG = {
    "_name_or_path": VERSION,  # what seed_demo records: the weights' directory
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
TINY = Architecture.from_config(TINY_CONFIG)


def safetensors(tensors: dict[str, list[int]], *, tamper: Any = None, variant: int = 0) -> bytes:
    """A safetensors file of F32 tensors with deterministic values. Another ``variant`` is
    another adapter whose weights point another way: the tiny model answers it differently
    (an adapter whose weights are only scaled changes the answer as its original does)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = bytearray()
    for name, shape in tensors.items():
        count = shape[0] * shape[1]
        shift = 0.05 if variant else 0.0
        values = array(
            "f", (((i * 7919 + variant * 3571) % 1000) / 1e4 - shift for i in range(count))
        ).tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(values)],
        }
        data += values
    if tamper:
        tamper(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data)


def scaled_weights(weights: bytes, factor: float) -> bytes:
    """The same adapter layout with every (float32) value times ``factor``: another adapter
    file (the tiny model's answer to it is the original's; ``safetensors(variant=...)``
    makes one that answers differently)."""
    header_end = 8 + int.from_bytes(weights[:8], "little")
    values = array("f", weights[header_end:])
    return weights[:header_end] + array("f", (factor * v for v in values)).tobytes()


def lora_tensors(
    rank: int = 8, modules: tuple[str, ...] = ("q_proj", "v_proj")
) -> dict[str, list[int]]:
    out = {}
    for layer in range(TINY.num_hidden_layers):
        for module in modules:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_f, out_f = TINY.in_out(module)
            out[f"{prefix}.lora_A.weight"] = [rank, in_f]
            out[f"{prefix}.lora_B.weight"] = [out_f, rank]
    return out


def config(**overrides: Any) -> bytes:
    return json.dumps(
        {
            "peft_type": "LORA",
            "r": 8,
            "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"],
            "base_model_name_or_path": f"/models/{VERSION}",
            "task_type": "CAUSAL_LM",
            **overrides,
        }
    ).encode()
