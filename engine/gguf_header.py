"""Read a few metadata keys from a GGUF file's header without loading its tensors (and without torch)."""

from __future__ import annotations
from pathlib import Path
from typing import Any
from slotune.tuner.spec.yaml_reader import SpecError


# GGUF value types (gguf-py GGUFValueType): scalar sizes for the struct codes below; 8 = string, 9 = array.
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_header(path: Path, keys: tuple[str, ...], prefix: str | None = None) -> dict[str, Any]:
    """Scalar and string values of `keys`, and of every key starting with `prefix`, from a GGUF file's
    metadata (an array's value is None: the key is there, its items skipped), reading only up to the
    last key wanted when no prefix is given (gguf's GGUFReader decodes every field, the tokenizer's
    arrays included: seconds per file)."""
    import struct

    want, out = set(keys), {}
    with path.open("rb") as f:

        def read(fmt: str) -> Any:
            size = struct.calcsize("<" + fmt)
            data = f.read(size)
            if len(data) != size:
                raise SpecError("truncated GGUF metadata", source=path)
            return struct.unpack("<" + fmt, data)[0]

        def read_str() -> str:
            return f.read(read("Q")).decode("utf-8", "replace")

        def skip(vtype: int) -> None:
            if vtype in GGUF_SCALARS:
                f.seek(struct.calcsize("<" + GGUF_SCALARS[vtype]), 1)
            elif vtype == 8:
                f.seek(read("Q"), 1)
            elif vtype == 9:
                item, count = read("I"), read("Q")
                if item in GGUF_SCALARS:
                    f.seek(struct.calcsize("<" + GGUF_SCALARS[item]) * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                raise SpecError(f"unknown GGUF value type {vtype}", source=path)

        if f.read(4) != b"GGUF":
            raise SpecError("not a GGUF file", source=path)
        read("I")  # version
        read("Q")  # tensor count
        for _ in range(read("Q")):
            key, vtype = read_str(), read("I")
            if key in want or (prefix is not None and key.startswith(prefix)):
                out[key] = (
                    read(GGUF_SCALARS[vtype]) if vtype in GGUF_SCALARS else read_str() if vtype == 8 else skip(vtype)
                )
                if prefix is None and want <= out.keys():
                    break
            else:
                skip(vtype)
    return out
