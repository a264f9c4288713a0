"""Validating a tenant's LoRA adapter before any engine sees it: hostile until proven otherwise.

An adapter is PEFT's layout: ``adapter_config.json`` + ``adapter_model.safetensors``, given
as the two files or as one ``.zip`` / ``.tar.gz`` holding them. Only safetensors (a JSON
header and raw numbers: nothing in it can execute) is accepted; pickle formats are refused by
name and by content. Archives are unpacked by us, entry by entry, with every path, type and
size checked first, so traversal, links and bombs never reach the disk.

Each refusal is a ``Rejected`` with a reason meant for the person who uploaded the adapter.
"""

from __future__ import annotations

import json
import re
import struct
import tarfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path, PurePosixPath
from typing import Any

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
IGNORED = {"README.md", ".gitattributes"}  # what PEFT's save_pretrained also writes
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
MAX_CONFIG_BYTES = 64 * 1024
MAX_HEADER_BYTES = 1024 * 1024
MAX_ENTRIES = 16
MAX_COMPRESSION_RATIO = 200  # a real adapter compresses ~1.1x; a bomb, thousands of times
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_(A|B)\.weight$"
)


class Rejected(Exception):
    """The adapter cannot be served; ``str()`` says why, for the person who uploaded it."""


@dataclass(frozen=True)
class Architecture:
    """What of the base model's config decides the shape of every LoRA tensor."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Architecture:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
        )

    def in_out(self, module: str) -> tuple[int, int]:
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        return {
            "q_proj": (self.hidden_size, q),
            "k_proj": (self.hidden_size, kv),
            "v_proj": (self.hidden_size, kv),
            "o_proj": (q, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }[module]


@dataclass(frozen=True)
class AdapterInfo:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str
    tensors: int


# --- Files and archives ---------------------------------------------------------------------


def _check_name(name: str) -> str | None:
    """The file's role (CONFIG, WEIGHTS) or None to skip it; refuses what must not be there."""
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or name.startswith("/"):
        raise Rejected(f"The archive entry {name!r} points outside the adapter.")
    base = path.name
    if base.lower().endswith(PICKLE_SUFFIXES):
        raise Rejected(
            f"{base!r} is a pickle-based format, which can run code when loaded. "
            f"Save the adapter with safetensors ({WEIGHTS})."
        )
    if base in (CONFIG, WEIGHTS):
        return base
    if base in IGNORED or name.endswith("/"):
        return None
    raise Rejected(f"Unexpected file {name!r}: an adapter holds only {CONFIG} and {WEIGHTS}.")


def unpack(archive: Path, dest: Path, *, max_bytes: int) -> dict[str, Path]:
    """Extract the adapter's two files from a .zip or .tar.gz into ``dest``, checking every
    entry before writing a byte of it. Returns {CONFIG: path, WEIGHTS: path}."""
    with archive.open("rb") as f:
        magic = f.read(4)
    if magic.startswith(b"PK"):
        return _unpack_zip(archive, dest, max_bytes=max_bytes)
    if magic.startswith(b"\x1f\x8b"):
        return _unpack_tar(archive, dest, max_bytes=max_bytes)
    raise Rejected("The archive is neither a .zip nor a .tar.gz.")


def _copy_capped(src: Any, target: Path, limit: int) -> int:
    written = 0
    with target.open("wb") as out:
        while chunk := src.read(1 << 20):
            written += len(chunk)
            if written > limit:
                raise Rejected(f"A file in the archive unpacks to more than {limit:,} bytes.")
            out.write(chunk)
    return written


def _unpack_zip(archive: Path, dest: Path, *, max_bytes: int) -> dict[str, Path]:
    try:
        zf = zipfile.ZipFile(archive)
    except zipfile.BadZipFile:
        raise Rejected("The .zip archive is damaged.") from None
    with zf:
        entries = zf.infolist()
        if len(entries) > MAX_ENTRIES:
            raise Rejected(f"The archive holds {len(entries)} entries; an adapter needs 2.")
        found: dict[str, Path] = {}
        total = 0
        for info in entries:
            mode = info.external_attr >> 16
            if mode and (mode & 0o170000) not in (0, 0o100000, 0o040000):
                raise Rejected(f"The archive entry {info.filename!r} is a link or special file.")
            role = _check_name(info.filename)
            if role is None:
                continue
            if role in found:
                raise Rejected(f"The archive holds {role} twice.")
            total += info.file_size
            ratio = info.file_size / max(info.compress_size, 1)
            if total > max_bytes or ratio > MAX_COMPRESSION_RATIO:
                raise Rejected("The archive unpacks to far more than an adapter (an archive bomb).")
            with zf.open(info) as src:
                # Declared sizes can lie: the copy is capped by what is really read.
                _copy_capped(src, dest / role, max_bytes)
            found[role] = dest / role
    return _both(found)


def _unpack_tar(archive: Path, dest: Path, *, max_bytes: int) -> dict[str, Path]:
    found: dict[str, Path] = {}
    seen = 0
    read_limit = max_bytes
    try:
        with tarfile.open(archive, "r:gz") as tf:
            for member in tf:
                seen += 1
                if seen > MAX_ENTRIES:
                    raise Rejected(f"The archive holds more than {MAX_ENTRIES} entries.")
                if not (member.isfile() or member.isdir()):
                    raise Rejected(f"The archive entry {member.name!r} is a link or special file.")
                role = _check_name(member.name)
                if member.isdir() or role is None:
                    continue
                if role in found:
                    raise Rejected(f"The archive holds {role} twice.")
                if member.size > read_limit:
                    raise Rejected("The archive unpacks to far more than an adapter allows.")
                src = tf.extractfile(member)
                if src is None:
                    raise Rejected(f"The archive entry {member.name!r} cannot be read.")
                read_limit -= _copy_capped(src, dest / role, read_limit)
                found[role] = dest / role
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise Rejected(f"The .tar.gz archive is damaged ({type(exc).__name__}).") from None
    return _both(found)


def _both(found: dict[str, Path]) -> dict[str, Path]:
    missing = [name for name in (CONFIG, WEIGHTS) if name not in found]
    if missing:
        raise Rejected(f"The adapter is missing {' and '.join(missing)}.")
    return found


# --- Content ------------------------------------------------------------------------------------


def read_config(
    path: Path, *, base_names: Iterable[str], max_rank: int
) -> tuple[int, float, tuple[str, ...], str]:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise Rejected(f"{CONFIG} is larger than {MAX_CONFIG_BYTES // 1024} KB.")
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError):
        raise Rejected(f"{CONFIG} is not valid JSON.") from None
    if not isinstance(config, dict):
        raise Rejected(f"{CONFIG} must be a JSON object.")
    if config.get("peft_type") != "LORA":
        raise Rejected(f"Only LoRA adapters are served (peft_type is {config.get('peft_type')!r}).")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise Rejected(f"{CONFIG} needs a positive integer rank r.")
    if rank > max_rank:
        raise Rejected(f"Rank {rank} is above this pool's maximum LoRA rank of {max_rank}.")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise Rejected("lora_alpha must be a number.")
    modules = config.get("target_modules")
    if isinstance(modules, str) or not isinstance(modules, list) or not modules:
        raise Rejected("target_modules must be a non-empty list of module names.")
    unsupported = sorted({str(m) for m in modules} - set(SUPPORTED_MODULES))
    if unsupported:
        raise Rejected(
            f"Unsupported target modules {unsupported}; supported: {', '.join(SUPPORTED_MODULES)}."
        )
    # Variants vLLM's LoRA loader refuses at load time: refused here, with the reason.
    if config.get("use_dora"):
        raise Rejected("DoRA adapters (use_dora) are not supported; train a plain LoRA.")
    if config.get("modules_to_save"):
        raise Rejected(
            "modules_to_save is not supported: the adapter may only hold LoRA A/B matrices."
        )
    if config.get("bias", "none") not in ("none", None):
        raise Rejected("LoRA bias terms are not supported (bias must be 'none').")
    base = str(config.get("base_model_name_or_path") or "")
    names = {n for name in base_names if name for n in (name, PurePosixPath(name).name)}
    if base not in names and PurePosixPath(base).name not in names:
        raise Rejected(
            f"The adapter was trained for {base or 'an unnamed model'!r}, not for a model served "
            f"here ({', '.join(sorted(names))})."
        )
    return rank, float(alpha), tuple(sorted(set(modules))), base


def check_weights(path: Path, *, rank: int, modules: tuple[str, ...], arch: Architecture) -> int:
    """Parse the safetensors header (never the data as objects) and check every tensor's
    name, type, shape and place in the file against the base model. Returns the count."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise Rejected(f"{WEIGHTS} is not a safetensors file (too short).")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise Rejected(f"{WEIGHTS} is not a safetensors file (bad header length).")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, UnicodeDecodeError):
            raise Rejected(f"{WEIGHTS} is not a safetensors file (header is not JSON).") from None
    if not isinstance(header, dict):
        raise Rejected(f"{WEIGHTS} has a malformed header.")
    header.pop("__metadata__", None)
    data_len = size - 8 - header_len
    spans: list[tuple[int, int]] = []
    seen: set[tuple[int, str, str]] = set()
    for name, spec in header.items():
        match = TENSOR_NAME.match(name)
        if not match:
            raise Rejected(f"Tensor {name!r} is not a LoRA weight of a supported module.")
        layer, block, module, ab = int(match[1]), match[2], match[3], match[4]
        if layer >= arch.num_hidden_layers:
            raise Rejected(
                f"Tensor {name!r} is for layer {layer}; the base model has "
                f"{arch.num_hidden_layers} layers."
            )
        expected_block = (
            "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
        )
        if block != expected_block or module not in modules:
            raise Rejected(f"Tensor {name!r} is not for one of target_modules {list(modules)}.")
        if not isinstance(spec, dict):
            raise Rejected(f"Tensor {name!r} has a malformed description.")
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise Rejected(f"Tensor {name!r} is {dtype}; use F32, F16 or BF16.")
        in_features, out_features = arch.in_out(module)
        want = [rank, in_features] if ab == "A" else [out_features, rank]
        if shape != want:
            raise Rejected(
                f"Tensor {name!r} has shape {shape}; for this base model and rank {rank} it "
                f"must be {want}."
            )
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len
            or offsets[1] - offsets[0] != want[0] * want[1] * DTYPE_BYTES[dtype]
        ):
            raise Rejected(f"Tensor {name!r} points outside the file or has the wrong size.")
        spans.append((offsets[0], offsets[1]))
        seen.add((layer, module, ab))
    spans.sort()
    for (_, end), (start, _) in pairwise(spans):
        if start < end:
            raise Rejected(f"{WEIGHTS} has overlapping tensors.")
    for layer in range(arch.num_hidden_layers):
        for module in modules:
            for ab in "AB":
                if (layer, module, ab) not in seen:
                    raise Rejected(f"{WEIGHTS} lacks lora_{ab} of {module} in layer {layer}.")
    return len(header)


def validate(
    files: dict[str, Path], *, base_names: Iterable[str], max_rank: int, arch: Architecture
) -> AdapterInfo:
    rank, alpha, modules, base = read_config(
        files[CONFIG], base_names=base_names, max_rank=max_rank
    )
    tensors = check_weights(files[WEIGHTS], rank=rank, modules=modules, arch=arch)
    return AdapterInfo(
        rank=rank, alpha=alpha, target_modules=modules, base_model=base, tensors=tensors
    )
