"""Validating a tenant's LoRA adapter before any engine sees it: hostile until proven otherwise.

An adapter is PEFT's layout: ``adapter_config.json`` + ``adapter_model.safetensors``, given
as the two files or as one ``.zip`` / ``.tar.gz`` holding them. Only safetensors (a JSON
header and raw numbers: nothing in it can execute) is accepted; pickle formats are refused by
name and by content. Archives are unpacked by us, entry by entry, with every path, type and
size checked first, so traversal, links and bombs never reach the disk.

Each refusal is a ``Rejected`` with a reason meant for the person who uploaded the adapter.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import itertools
import json
import lzma
import math
import re
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterable
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
RATIO_FLOOR_BYTES = 1024 * 1024  # below this, nothing inflates far enough to matter
# What tar spends besides members' data (headers, pax records, padding, the end blocks).
TAR_OVERHEAD_BYTES = 1024 * 1024
CHUNK = 1 << 20
# What reading a damaged or hostile archive raises, from zipfile, tarfile, gzip, zlib, lzma
# (the methods zipfile supports) and the bounds checks inside them.
ARCHIVE_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    tarfile.TarError,
    EOFError,
    OSError,
    zlib.error,
    lzma.LZMAError,
    NotImplementedError,
    RuntimeError,
    ValueError,
    struct.error,
)
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


def _damaged(kind: str, exc: BaseException) -> Rejected:
    return Rejected(f"The {kind} archive is damaged ({type(exc).__name__}).")


def _copy_capped(src: Any, target: Path, limit: int, *, kind: str) -> int:
    """Copy at most ``limit`` bytes; reading errors are the archive's fault, writing ones
    (the worker's disk) are not and propagate."""
    written = 0
    with target.open("wb") as out:
        while True:
            try:
                chunk = src.read(CHUNK)
            except ARCHIVE_ERRORS as exc:
                raise _damaged(kind, exc) from None
            if not chunk:
                return written
            written += len(chunk)
            if written > limit:
                raise Rejected("The archive unpacks to far more than an adapter allows.")
            out.write(chunk)


def _unpack_zip(archive: Path, dest: Path, *, max_bytes: int) -> dict[str, Path]:
    try:
        zf = zipfile.ZipFile(archive)
    except ARCHIVE_ERRORS as exc:
        raise _damaged(".zip", exc) from None
    with zf:
        entries = zf.infolist()
        if len(entries) > MAX_ENTRIES:
            raise Rejected(f"The archive holds {len(entries)} entries; an adapter needs 2.")
        wanted: dict[str, zipfile.ZipInfo] = {}
        declared = 0
        for info in entries:
            # Every entry counts, the ones skipped below too: an archive that declares more
            # than an adapter may hold is refused before anything is inflated.
            declared += info.file_size
            ratio = info.file_size / max(info.compress_size, 1)
            if declared > max_bytes or (
                info.file_size > RATIO_FLOOR_BYTES and ratio > MAX_COMPRESSION_RATIO
            ):
                raise Rejected("The archive unpacks to far more than an adapter (an archive bomb).")
            mode = info.external_attr >> 16
            if mode and (mode & 0o170000) not in (0, 0o100000, 0o040000):
                raise Rejected(f"The archive entry {info.filename!r} is a link or special file.")
            role = _check_name(info.filename)
            if role is None:
                continue
            if info.flag_bits & 0x1:
                raise Rejected(
                    f"The archive entry {info.filename!r} is encrypted; upload it unencrypted."
                )
            if role in wanted:
                raise Rejected(f"The archive holds {role} twice.")
            wanted[role] = info
        budget = max_bytes
        for role, info in wanted.items():
            try:
                src = zf.open(info)
            except ARCHIVE_ERRORS as exc:
                raise _damaged(".zip", exc) from None
            with src:
                # Declared sizes can lie: the copy is capped by what is really read, and a
                # wrong CRC-32 surfaces (as BadZipFile) from the last read.
                budget -= _copy_capped(src, dest / role, budget, kind=".zip")
    return _both({role: dest / role for role in wanted})


class _Inflated:
    """A .tar.gz's decompressed stream that refuses to produce more than ``limit`` bytes, or
    more than ``MAX_COMPRESSION_RATIO`` times the archive's size.

    tarfile inflates whatever it passes over (members it is told to skip, directories, pax
    headers it reads into memory whole) just to reach the next header, so the bound has to
    sit under tarfile, on every byte it reads, not on the members we extract.
    """

    def __init__(self, archive: Path, *, limit: int) -> None:
        self._gz = gzip.GzipFile(archive, "rb")
        self._limit = limit
        self._ratio_limit = max(RATIO_FLOOR_BYTES, archive.stat().st_size * MAX_COMPRESSION_RATIO)
        self.inflated = 0

    def read(self, size: int = -1) -> bytes:
        # tarfile's stream mode always asks for a block-sized amount; never read unbounded.
        chunk = self._gz.read(size if 0 <= size <= CHUNK else CHUNK)
        self.inflated += len(chunk)
        if self.inflated > self._ratio_limit:
            raise Rejected("The archive unpacks to far more than an adapter (an archive bomb).")
        if self.inflated > self._limit:
            raise Rejected("The archive unpacks to far more than an adapter allows.")
        return chunk

    def close(self) -> None:
        self._gz.close()


def _tar_read[T](step: Callable[[], T]) -> T:
    """One step of reading the .tar.gz, its errors the archive's."""
    try:
        return step()
    except ARCHIVE_ERRORS as exc:
        raise _damaged(".tar.gz", exc) from None


def _drain(stream: _Inflated) -> None:
    while stream.read(CHUNK):
        pass


def _unpack_tar(archive: Path, dest: Path, *, max_bytes: int) -> dict[str, Path]:
    found: dict[str, Path] = {}
    with contextlib.closing(_Inflated(archive, limit=max_bytes + TAR_OVERHEAD_BYTES)) as stream:
        # Stream mode ("r|"): strictly forward, every byte through ``stream``.
        # (typeshed wants a seekable file even for stream mode, which never seeks)
        tf = _tar_read(
            lambda: tarfile.open(fileobj=stream, mode="r|")  # type: ignore[call-overload]  # noqa: SIM115
        )
        with tf:
            declared = 0
            for seen in itertools.count(1):
                member = _tar_read(tf.next)
                if member is None:
                    break
                if seen > MAX_ENTRIES:
                    raise Rejected(f"The archive holds more than {MAX_ENTRIES} entries.")
                # Counted before the next header is looked for: getting there inflates this
                # member's data, whether it is extracted or skipped.
                declared += member.size
                if declared > max_bytes:
                    raise Rejected("The archive unpacks to far more than an adapter allows.")
                if member.issparse():
                    raise Rejected(
                        f"The archive entry {member.name!r} is a sparse file; "
                        "archive the adapter without --sparse."
                    )
                if not (member.isfile() or member.isdir()):
                    raise Rejected(f"The archive entry {member.name!r} is a link or special file.")
                role = _check_name(member.name)
                if member.isdir() or role is None:
                    continue
                if role in found:
                    raise Rejected(f"The archive holds {role} twice.")
                src = _tar_read(functools.partial(tf.extractfile, member))
                if src is None:
                    raise Rejected(f"The archive entry {member.name!r} cannot be read.")
                _copy_capped(src, dest / role, member.size, kind=".tar.gz")
                found[role] = dest / role
            # Read to the end, still within the bound: gzip checks its CRC-32 only there.
            _tar_read(lambda: _drain(stream))
    return _both(found)


def _both(found: dict[str, Path]) -> dict[str, Path]:
    missing = [name for name in (CONFIG, WEIGHTS) if name not in found]
    if missing:
        raise Rejected(f"The adapter is missing {' and '.join(missing)}.")
    return found


# --- Content ------------------------------------------------------------------------------------


def _json(raw: bytes, what: str, invalid: str) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        # Python's parser recurses per level of nesting; no adapter nests more than a few.
        raise Rejected(f"{what} is nested too deeply to be an adapter's.") from None
    except (ValueError, UnicodeDecodeError):
        raise Rejected(invalid) from None


def _shown(value: Any) -> str:
    """A value from an uploaded file, short enough for a reason (JSON can nest and sprawl)."""
    if isinstance(value, str | int | float | bool) or value is None:
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, list) and all(isinstance(v, int) for v in value) and len(value) <= 4:
        return repr(value)
    return f"a JSON {'array' if isinstance(value, list) else 'object'}"


def read_config(
    path: Path, *, base_names: Iterable[str], max_rank: int
) -> tuple[int, float, tuple[str, ...], str]:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise Rejected(f"{CONFIG} is larger than {MAX_CONFIG_BYTES // 1024} KB.")
    config = _json(path.read_bytes(), CONFIG, f"{CONFIG} is not valid JSON.")
    if not isinstance(config, dict):
        raise Rejected(f"{CONFIG} must be a JSON object.")
    if config.get("peft_type") != "LORA":
        raise Rejected(
            f"Only LoRA adapters are served (peft_type is {_shown(config.get('peft_type'))})."
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise Rejected(f"{CONFIG} needs a positive integer rank r.")
    if rank > max_rank:
        raise Rejected(f"Rank {rank} is above this pool's maximum LoRA rank of {max_rank}.")
    alpha = config.get("lora_alpha", rank)
    if (
        not isinstance(alpha, int | float)
        or isinstance(alpha, bool)
        or abs(alpha) > 1e9  # 10**400 parses (as an int: no float holds it)
        or not math.isfinite(alpha)  # NaN and Infinity parse too
    ):
        raise Rejected("lora_alpha must be a finite number.")
    modules = config.get("target_modules")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise Rejected("target_modules must be a non-empty list of module names.")
    unsupported = sorted({m[:40] for m in modules} - set(SUPPORTED_MODULES))
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
    base = config.get("base_model_name_or_path") or ""
    if not isinstance(base, str):
        raise Rejected("base_model_name_or_path must be the base model's name (a string).")
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
        header = _json(
            f.read(header_len),
            f"{WEIGHTS}'s header",
            f"{WEIGHTS} is not a safetensors file (header is not JSON).",
        )
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
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise Rejected(f"Tensor {name!r} is {_shown(dtype)}; use F32, F16 or BF16.")
        in_features, out_features = arch.in_out(module)
        want = [rank, in_features] if ab == "A" else [out_features, rank]
        if shape != want:
            raise Rejected(
                f"Tensor {name!r} has shape {_shown(shape)}; for this base model and rank "
                f"{rank} it must be {want}."
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
