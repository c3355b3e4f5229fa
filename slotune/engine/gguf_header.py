"""Read a GGUF file's metadata and tensor list without loading its tensors (and without torch)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from slotune.tuner.spec.yaml_reader import SpecError

# GGUF value types (gguf-py GGUFValueType): scalar sizes for the struct codes below; 8 = string, 9 = array.
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SMALL_ARRAY = 4096  # scalar arrays up to this long are decoded (per-layer lists); longer ones (vocabularies) not


@dataclass(frozen=True, slots=True)
class Skipped:
    """A long array in `read_gguf_layout`'s metadata: its length, not its items."""

    length: int

    def __len__(self) -> int:
        return self.length


class _Reader:
    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f, self.path = f, path

    def read(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise SpecError("truncated GGUF metadata", source=self.path)
        return struct.unpack("<" + fmt, data)[0]

    def read_str(self) -> str:
        return self.f.read(self.read("Q")).decode("utf-8", "replace")

    def value(self, vtype: int, decode: bool) -> Any:
        """A scalar or string; an array's items when `decode` and short and scalar, else skipped:
        None, or with `decode` its length (Skipped)."""
        if vtype in GGUF_SCALARS:
            return self.read(GGUF_SCALARS[vtype])
        if vtype == 8:
            return self.read_str()
        if vtype != 9:
            raise SpecError(f"unknown GGUF value type {vtype}", source=self.path)
        item, count = self.read("I"), self.read("Q")
        if item in GGUF_SCALARS:
            fmt = GGUF_SCALARS[item]
            if decode and count <= _SMALL_ARRAY:
                return list(struct.unpack(f"<{count}{fmt}", self.f.read(struct.calcsize(fmt) * count)))
            self.f.seek(struct.calcsize("<" + fmt) * count, 1)
        else:
            for _ in range(count):
                self.value(item, decode=False)
        return Skipped(count) if decode else None


def read_gguf_header(path: Path, keys: tuple[str, ...], prefix: str | None = None) -> dict[str, Any]:
    """Scalar and string values of `keys`, and of every key starting with `prefix`, from a GGUF file's
    metadata (an array's value is None: the key is there, its items skipped), reading only up to the
    last key wanted when no prefix is given (gguf's GGUFReader decodes every field, the tokenizer's
    arrays included: seconds per file)."""
    want, out = set(keys), {}
    with path.open("rb") as f:
        r = _start(f, path)
        r.read("Q")  # tensor count
        for _ in range(r.read("Q")):
            key, vtype = r.read_str(), r.read("I")
            wanted = key in want or (prefix is not None and key.startswith(prefix))
            value = r.value(vtype, decode=False)
            if wanted:
                out[key] = value
                if prefix is None and want <= out.keys():
                    break
    return out


def read_gguf_layout(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """Every metadata key (long arrays as their length: Skipped) and every tensor's name and shape, HF order
    ([rows, cols]), as `loader` sees them after reading the whole file."""
    with path.open("rb") as f:
        r = _start(f, path)
        n_tensors = r.read("Q")
        meta = {}
        for _ in range(r.read("Q")):
            key, vtype = r.read_str(), r.read("I")
            meta[key] = r.value(vtype, decode=True)
        tensors = {}
        for _ in range(n_tensors):
            name, n_dims = r.read_str(), r.read("I")
            dims = [r.read("Q") for _ in range(n_dims)]
            r.read("I")  # ggml type
            r.read("Q")  # data offset
            tensors[name] = tuple(reversed(dims))  # GGUF lists dims fastest-first
    return meta, tensors


def gguf_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key with its whole value (vocabularies included), by gguf's reader."""
    from gguf import GGUFReader

    out = {}
    for key, field in GGUFReader(str(path)).fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # pragma: no cover - exotic field types
            out[key] = None
    return out


def _start(f: BinaryIO, path: Path) -> _Reader:
    if f.read(4) != b"GGUF":
        raise SpecError("not a GGUF file", source=path)
    r = _Reader(f, path)
    r.read("I")  # version
    return r
