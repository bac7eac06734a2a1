"""Reading a weight file's header without reading its tensors: what the checks of a base model's
weights and of an ``init_adapter`` compare against the model."""

from __future__ import annotations

import math
import os

from mlora_lab.text import brief, is_int, parse_json

ST_BYTES = {
    **dict.fromkeys(("F64", "I64", "U64", "C64"), 8),
    **dict.fromkeys(("F32", "I32", "U32"), 4),
    **dict.fromkeys(("F16", "BF16", "I16", "U16"), 2),
    **dict.fromkeys(("I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0"), 1),
}
"""Bytes per element of the safetensors dtypes (sub-byte and unknown ones are not size-checked)."""


def safetensors_shapes(path: str) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """The tensor shapes a safetensors file declares, from its header only (no tensor is read), or
    ``({}, why)`` when it is not a complete safetensors file.

    Layout: ``N`` (8 bytes, little-endian), ``N`` bytes of JSON ``{name: {dtype, shape, data_offsets:
    [begin, end]}, "__metadata__": {...}}``, then the data, ``end`` bytes at most. A pickle renamed to
    ``.safetensors`` gives an absurd ``N``; a truncated download, a tensor that ends past the file.
    """
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as fh:
            head = fh.read(9)
            if size == 0:
                return {}, "it is empty"
            if len(head) < 8:
                return {}, f"it is truncated ({size} bytes)"
            n = int.from_bytes(head[:8], "little")
            # safetensors' own limit on the header; and the header is a JSON object
            if n > 100 * 2**20 or head[8:9] not in (b"{", b""):
                return {}, "it is not a safetensors file (no valid header)"
            if 8 + n > size:
                return {}, f"it is truncated (its header needs {8 + n} bytes, the file has {size})"
            raw = head[8:] + fh.read(n - 1) if n else b""
    except OSError as e:
        return {}, f"it cannot be read ({e.strerror or e})"
    header = parse_json(raw)[0] if raw[:1] == b"{" else None
    if not isinstance(header, dict):
        return {}, "it is not a safetensors file (its header is not a JSON object)"
    data = size - 8 - n
    shapes: dict[str, tuple[int, ...]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(shape, list)
            and all(is_int(d) and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            return {}, f"it is not a safetensors file (bad header entry {brief(key)})"
        if offsets[1] > data:
            return {}, f"it is truncated (tensor {brief(key)} ends at byte {offsets[1]} of {data})"
        width = ST_BYTES.get(info.get("dtype"))
        if width is not None and offsets[1] - offsets[0] != math.prod(shape) * width:
            return {}, f"it is not a safetensors file (tensor {brief(key)} has the wrong byte count)"
        shapes[key] = tuple(shape)
    return shapes, None
