"""LoRA adapter validation: real PEFT-layout adapters for the tiny model pass; malformed,
pickle-bearing, wrong-base, wrong-shape and hostile archives are refused with a reason."""

from __future__ import annotations

import io
import struct
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from adapters.validation import CONFIG, WEIGHTS, Rejected, unpack, validate
from devkit.adapters import TINY, config, lora_tensors, safetensors
from devkit.tiny_model import VERSION

BASES = ["tiny-chat", f"/models/{VERSION}"]
MB = 1024 * 1024


def write_adapter(
    folder: Path, *, cfg: bytes | None = None, weights: bytes | None = None
) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_bytes(cfg if cfg is not None else config())
    (folder / WEIGHTS).write_bytes(weights if weights is not None else safetensors(lora_tensors()))
    return {CONFIG: folder / CONFIG, WEIGHTS: folder / WEIGHTS}


def check(files: dict[str, Path], max_rank: int = 8) -> Any:
    return validate(files, base_names=BASES, max_rank=max_rank, arch=TINY)


def test_a_real_adapter_passes(tmp_path: Path) -> None:
    info = check(write_adapter(tmp_path))
    assert (info.rank, info.alpha, info.target_modules, info.tensors) == (
        8,
        16.0,
        ("q_proj", "v_proj"),
        8,
    )


def test_every_supported_module_and_a_smaller_rank(tmp_path: Path) -> None:
    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    files = write_adapter(
        tmp_path,
        cfg=config(r=4, target_modules=list(modules)),
        weights=safetensors(lora_tensors(4, modules)),
    )
    assert check(files).tensors == 2 * 7 * 2


@pytest.mark.parametrize(
    ("cfg", "reason"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (config(peft_type="PREFIX_TUNING"), "Only LoRA"),
        (config(r=16), "above this pool's maximum LoRA rank of 8"),
        (config(r="8"), "positive integer rank"),
        (config(target_modules="q_proj"), "non-empty list"),
        (config(target_modules=["q_proj", "lm_head"]), "Unsupported target modules ['lm_head']"),
        (config(base_model_name_or_path="meta-llama/Llama-3-8B"), "trained for 'meta-llama"),
        (config(use_dora=True), "DoRA adapters"),
        (config(modules_to_save=["lm_head"]), "modules_to_save is not supported"),
        (config(bias="all"), "bias terms are not supported"),
    ],
)
def test_bad_configs_are_refused_with_a_reason(tmp_path: Path, cfg: bytes, reason: str) -> None:
    with pytest.raises(Rejected, match=reason.replace("[", r"\[").replace("]", r"\]")):
        check(write_adapter(tmp_path, cfg=cfg))


def _drop(name: str) -> Any:
    return lambda header: header.pop(name)


@pytest.mark.parametrize(
    ("weights", "reason"),
    [
        (b"\x80\x04\x95pickle-bytes", "not a safetensors file"),
        (struct.pack("<Q", 10**9) + b"{}", "bad header length"),
        (struct.pack("<Q", 4) + b"nope", "header is not JSON"),
        (
            safetensors({**lora_tensors(), "lm_head.weight": [512, 128]}),
            "not a LoRA weight",
        ),
        (
            safetensors(
                lora_tensors(),
                tamper=_drop("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"),
            ),
            "lacks lora_B of v_proj in layer 1",
        ),
        (safetensors(lora_tensors(rank=4)), "must be \\[8, 128\\]"),
        (
            safetensors(
                {
                    **lora_tensors(),
                    "base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": [8, 128],
                }
            ),
            "the base model has 2 layers",
        ),
        (
            safetensors(
                lora_tensors(),
                tamper=lambda h: h[
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
                ].update(data_offsets=[0, 10**9]),
            ),
            "points outside the file",
        ),
        (
            safetensors(
                lora_tensors(),
                tamper=lambda h: h[
                    "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"
                ].update(data_offsets=[0, 4096]),
            ),
            "overlapping",
        ),
        (
            safetensors(
                lora_tensors(),
                tamper=lambda h: h[
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
                ].update(dtype="I64"),
            ),
            "use F32, F16 or BF16",
        ),
    ],
)
def test_bad_weights_are_refused_with_a_reason(tmp_path: Path, weights: bytes, reason: str) -> None:
    with pytest.raises(Rejected, match=reason):
        check(write_adapter(tmp_path, weights=weights))


# --- Archives -----------------------------------------------------------------------------------


def zip_of(entries: dict[str, bytes], *, symlink: str | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
        if symlink:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = 0o120777 << 16
            zf.writestr(info, "/etc/passwd")
    return buf.getvalue()


def tar_of(entries: dict[str, bytes], *, link: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tf.addfile(info)
    return buf.getvalue()


GOOD = {f"my-adapter/{CONFIG}": config(), f"my-adapter/{WEIGHTS}": safetensors(lora_tensors())}


@pytest.mark.parametrize("pack", [zip_of, tar_of])
def test_archives_of_a_real_adapter_pass(tmp_path: Path, pack: Any) -> None:
    archive = tmp_path / "upload"
    archive.write_bytes(pack({**GOOD, "my-adapter/README.md": b"# notes"}))
    out = tmp_path / "out"
    out.mkdir()
    files = unpack(archive, out, max_bytes=10 * MB)
    assert check(files).tensors == 8
    assert sorted(p.name for p in out.iterdir()) == [CONFIG, WEIGHTS]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (zip_of({**GOOD, "../../etc/cron.d/evil": b"x"}), "points outside"),
        (zip_of({**GOOD, "/etc/evil": b"x"}), "points outside"),
        (zip_of(GOOD, symlink="my-adapter/link"), "link or special file"),
        (tar_of(GOOD, link="my-adapter/link"), "link or special file"),
        (tar_of({**GOOD, "../evil": b"x"}), "points outside"),
        (zip_of({**GOOD, "my-adapter/pytorch_model.bin": b"\x80\x04"}), "pickle-based"),
        (tar_of({f"a/{CONFIG}": config(), "a/adapter_model.bin": b"\x80\x04"}), "pickle-based"),
        (zip_of({**GOOD, "my-adapter/train.py": b"import os"}), "Unexpected file"),
        (zip_of({f"a/{CONFIG}": config()}), f"missing {WEIGHTS}"),
        (zip_of({f"{i}/README.md": b"" for i in range(20)}), "entries"),
        (b"not an archive at all", "neither a .zip nor a .tar.gz"),
        (b"PK\x03\x04 broken", "damaged"),
        (b"\x1f\x8b broken", "damaged"),
    ],
)
def test_hostile_archives_are_refused_and_leave_nothing_outside(
    tmp_path: Path, payload: bytes, reason: str
) -> None:
    archive = tmp_path / "upload"
    archive.write_bytes(payload)
    out = tmp_path / "sandbox" / "out"
    out.mkdir(parents=True)
    with pytest.raises(Rejected, match=reason):
        unpack(archive, out, max_bytes=10 * MB)
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert written <= {"upload", f"sandbox/out/{CONFIG}", f"sandbox/out/{WEIGHTS}"}


def test_archive_bombs_are_refused(tmp_path: Path) -> None:
    zeros = bytes(64 * MB)  # compresses about 1000 to 1
    zip_bomb = tmp_path / "bomb.zip"
    zip_bomb.write_bytes(zip_of({f"a/{CONFIG}": config(), f"a/{WEIGHTS}": zeros}))
    with pytest.raises(Rejected, match="archive bomb"):
        unpack(zip_bomb, tmp_path, max_bytes=512 * MB)
    tar_bomb = tmp_path / "bomb.tgz"
    tar_bomb.write_bytes(tar_of({f"a/{CONFIG}": config(), f"a/{WEIGHTS}": zeros}))
    with pytest.raises(Rejected, match="far more than an adapter"):
        unpack(tar_bomb, tmp_path, max_bytes=8 * MB)


# --- Hostile content that used to escape the verdict ----------------------------------------


def deeply_nested(depth: int = 20_000) -> bytes:
    return b"[" * depth + b"]" * depth


def test_deeply_nested_json_is_refused_with_a_reason(tmp_path: Path) -> None:
    nested_config = b'{"peft_type": "LORA", "r": 8, "target_modules": ' + deeply_nested() + b"}"
    with pytest.raises(Rejected, match="nested too deeply"):
        check(write_adapter(tmp_path / "config", cfg=nested_config))
    raw = b'{"a": ' + deeply_nested(100_000) + b"}"
    nested_header = struct.pack("<Q", len(raw)) + raw
    with pytest.raises(Rejected, match="nested too deeply"):
        check(write_adapter(tmp_path / "header", weights=nested_header))


@pytest.mark.parametrize(
    ("weights", "reason"),
    [
        (
            safetensors(
                lora_tensors(),
                tamper=lambda h: h[
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
                ].update(dtype=["F32"]),
            ),
            "use F32, F16 or BF16",
        ),
    ],
)
def test_odd_json_types_are_refused_with_a_reason(
    tmp_path: Path, weights: bytes, reason: str
) -> None:
    with pytest.raises(Rejected, match=reason):
        check(write_adapter(tmp_path, weights=weights))


@pytest.mark.parametrize(
    ("cfg", "reason"),
    [
        (config(lora_alpha=10**400), "lora_alpha must be a finite number"),
        (config(lora_alpha=float("nan")), "lora_alpha must be a finite number"),
        (config(base_model_name_or_path=["tiny-chat"]), "base_model_name_or_path must be"),
    ],
)
def test_odd_config_values_are_refused_with_a_reason(
    tmp_path: Path, cfg: bytes, reason: str
) -> None:
    with pytest.raises(Rejected, match=reason):
        check(write_adapter(tmp_path, cfg=cfg))


def _patch_zip(payload: bytes, name: str, *, flag: int = 0, crc_xor: int = 0) -> bytes:
    """``payload`` with the headers (local and central) of entry ``name`` changed: flag
    bits set (bit 0: encrypted, as `zip -e` marks an entry) and/or its CRC-32 altered."""
    data = bytearray(payload)
    encoded = name.encode()
    # (signature, offset of the flag bits, of the CRC-32, of the file name) per header kind
    for signature, flag_at, crc_at, name_at in (
        (b"PK\x03\x04", 6, 14, 30),
        (b"PK\x01\x02", 8, 16, 46),
    ):
        start = data.find(signature)
        while start >= 0:
            if data[start + name_at : start + name_at + len(encoded)] == encoded:
                bits = struct.unpack_from("<H", data, start + flag_at)[0]
                struct.pack_into("<H", data, start + flag_at, bits | flag)
                crc = struct.unpack_from("<I", data, start + crc_at)[0]
                struct.pack_into("<I", data, start + crc_at, crc ^ crc_xor)
            start = data.find(signature, start + 4)
    return bytes(data)


def sparse_tar(real_size: int = 4096) -> bytes:
    """A .tar.gz whose weights are a GNU sparse member (512 stored bytes, ``real_size`` once
    the holes are filled in): what `tar --sparse` writes."""
    info = tarfile.TarInfo(f"a/{WEIGHTS}")
    info.type = tarfile.GNUTYPE_SPARSE
    info.size = 512
    block = bytearray(info.tobuf(format=tarfile.GNU_FORMAT)[:512])
    block[386:398] = b"%011o\0" % 0  # one data region: offset 0 ...
    block[398:410] = b"%011o\0" % 512  # ... 512 bytes long
    block[483:495] = b"%011o\0" % real_size
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        cfg = tarfile.TarInfo(f"a/{CONFIG}")
        cfg.size = len(config())
        tf.addfile(cfg, io.BytesIO(config()))
        tf.fileobj.write(bytes(block) + b"\x01" * 512)  # what addfile() would write
        tf.offset += 1024
    return buf.getvalue()


def corrupted(payload: bytes) -> bytes:
    """``payload`` with 64 bytes in the middle of its compressed data overwritten."""
    middle = len(payload) // 2
    return payload[:middle] + b"\xa5" * 64 + payload[middle + 64 :]


STORED_GOOD = {f"a/{CONFIG}": config(), f"a/{WEIGHTS}": safetensors(lora_tensors())}


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        # Entries that are skipped still count: tarfile inflates them to reach the next one.
        (tar_of({"a/README.md": bytes(16 * MB), **STORED_GOOD}), "far more than an adapter"),
        (tar_of({"a/": b"", "a/.gitattributes": bytes(16 * MB), **STORED_GOOD}), "far more"),
        (zip_of({"a/README.md": bytes(16 * MB), **STORED_GOOD}), "far more than an adapter"),
        (_patch_zip(zip_of(STORED_GOOD), f"a/{WEIGHTS}", flag=0x1), "encrypted"),
        (_patch_zip(zip_of(STORED_GOOD), f"a/{WEIGHTS}", crc_xor=0xFFFF), "damaged"),
        (corrupted(zip_of(STORED_GOOD)), "damaged"),
        (corrupted(tar_of(STORED_GOOD)), "damaged"),
        (sparse_tar(), "sparse"),
    ],
)
def test_archives_that_used_to_escape_are_refused(
    tmp_path: Path, payload: bytes, reason: str
) -> None:
    archive = tmp_path / "upload"
    archive.write_bytes(payload)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(Rejected, match=reason):
        unpack(archive, out, max_bytes=1 * MB)


def test_a_pax_header_cannot_inflate_past_the_cap(tmp_path: Path) -> None:
    """tarfile reads a pax extended header into memory whole, before any member is seen."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tf:
        for name, data in STORED_GOOD.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.pax_headers = {"comment": "x" * (8 * MB)} if name.endswith(CONFIG) else {}
            tf.addfile(info, io.BytesIO(data))
    archive = tmp_path / "upload"
    archive.write_bytes(buf.getvalue())
    with pytest.raises(Rejected, match="far more than an adapter"):
        unpack(archive, tmp_path, max_bytes=1 * MB)
