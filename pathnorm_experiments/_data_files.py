"""Readers of the data files, NumPy only: IDX (gzip or raw, and the complete records of a
truncated gzip), npz archives and SHA-256 checksums, and the checks of image and label arrays.

Every problem raises :class:`DataError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import gzip
import hashlib
import struct
import zlib
from pathlib import Path

import numpy as np

__all__ = [
    "IMAGE_MAGIC",
    "IMAGE_SHAPE",
    "LABEL_MAGIC",
    "N_CLASSES",
    "N_PIXELS",
    "DataError",
    "check_images",
    "check_labels",
    "file_sha256",
    "npz_arrays",
    "read_idx",
    "read_npz",
    "read_truncated_idx_gz",
]

IMAGE_MAGIC = 2051
LABEL_MAGIC = 2049
IMAGE_SHAPE = (28, 28)
N_PIXELS = 784
N_CLASSES = 10
# an IDX file of each kind: (magic number, header bytes, bytes per item)
_IDX_LAYOUT = {"images": (IMAGE_MAGIC, 16, N_PIXELS), "labels": (LABEL_MAGIC, 8, 1)}


class DataError(ValueError):
    """A data file is missing, corrupt, or does not match what the loader expects."""


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file (hex), read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _parse_idx(raw: bytes, path: Path, kind: str, *, allow_short: bool = False) -> np.ndarray:
    """Decode an uncompressed IDX byte string into uint8 (N, 28, 28) images or (N,) labels."""
    magic_expected, head, item = _IDX_LAYOUT[kind]
    if len(raw) < head:
        raise DataError(f"{path}: truncated IDX file ({len(raw)} bytes, header needs {head})")
    magic, count = struct.unpack(">II", raw[:8])
    if magic != magic_expected:
        raise DataError(
            f"{path}: bad IDX magic number {magic}, expected {magic_expected} for {kind} "
            "(wrong file, or not an IDX file)"
        )
    if kind == "images":
        rows, cols = struct.unpack(">II", raw[8:16])
        if (rows, cols) != IMAGE_SHAPE:
            raise DataError(f"{path}: images are {rows}x{cols}, expected 28x28")
    body = memoryview(raw)[head:]
    n_avail = len(body) // item
    if n_avail < count and not allow_short:
        raise DataError(
            f"{path}: truncated: header says {count} {kind}, the file holds {n_avail} "
            "(re-download it)"
        )
    if n_avail > count or (not allow_short and len(body) != count * item):
        raise DataError(f"{path}: {len(body)} data bytes, expected {count * item}")
    n = min(n_avail, count)
    arr = np.frombuffer(body[: n * item], dtype=np.uint8)
    return arr.reshape(n, *IMAGE_SHAPE) if kind == "images" else arr.copy()


def read_idx(path: str | Path, kind: str) -> np.ndarray:
    """Read an IDX file (``.gz`` or raw): ``kind`` is ``"images"`` or ``"labels"``."""
    if kind not in ("images", "labels"):
        raise ValueError(f"kind must be 'images' or 'labels', got {kind!r}")
    path = Path(path)
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot decompress ({e}); the file is corrupt or truncated") from e
    return _parse_idx(raw, path, kind)


def read_truncated_idx_gz(path: str | Path, kind: str = "images") -> np.ndarray:
    """Decode the complete records of a truncated IDX ``.gz`` file.

    ``gzip`` refuses a truncated stream; a ``zlib`` decompressor (gzip wrapper) returns what it
    holds.
    """
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 10 or data[:2] != b"\x1f\x8b":
        raise DataError(f"{path}: not a gzip file")
    try:
        raw = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)
    except zlib.error as e:
        raise DataError(f"{path}: corrupt deflate stream ({e})") from e
    return _parse_idx(raw, path, kind, allow_short=True)


_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # what np.load takes for an npz archive


def npz_arrays(path: Path, keys: tuple[str, ...], what: str, fix: str) -> list[np.ndarray]:
    """The arrays ``keys`` of the npz archive ``path``; a damaged or wrong file raises
    :class:`DataError` that starts with ``what`` and ends with ``fix`` (how to get a good copy).
    """

    def corrupt(problem: str) -> DataError:
        return DataError(
            f"{what}: cannot read npz ({problem}); the file is corrupt or truncated: {fix}"
        )

    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as e:
        raise corrupt(str(e)) from e
    if not head:
        raise corrupt("the file is empty")
    if head not in _ZIP_MAGIC:  # else np.load would take it for a pickle and suggest loading that
        raise corrupt(f"not a zip archive (an npz is one): it starts with {head!r}")
    try:
        with np.load(path) as z:
            for key in keys:
                if key not in z.files:
                    raise DataError(
                        f"{what}: no array {key!r} in the archive (it holds {z.files}): not the "
                        f"expected file: {fix}"
                    )
            return [z[key] for key in keys]
    except DataError:
        raise
    # Damaged bytes surface from zipfile, zlib and numpy's header parser as many types
    # (BadZipFile, EOFError, zlib.error, OSError, ValueError, tokenize.TokenError, ...).
    except Exception as e:
        raise corrupt(f"{type(e).__name__}: {e}") from e


def read_npz(path: Path, fix: str) -> np.ndarray:
    """The uint8 array ``arr_0`` of the npz ``path`` (a published KMNIST file)."""
    (arr,) = npz_arrays(path, ("arr_0",), str(path), fix)
    if arr.dtype != np.uint8:
        raise DataError(f"{path}: expected uint8, got {arr.dtype}: {fix}")
    return arr


def check_images(arr: np.ndarray, what: str, fix: str) -> None:
    """Refuse anything but uint8 images (N, 28, 28) or (N, 784), naming the problem."""
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        bad = int(np.count_nonzero(~np.isfinite(arr)))
        raise DataError(f"{what}: {bad} pixels are NaN or inf (pixels are uint8 0..255): {fix}")
    if arr.dtype != np.uint8:
        raise DataError(f"{what}: pixels must be uint8 (0..255), got {arr.dtype}: {fix}")
    if arr.ndim not in (2, 3) or arr.shape[1:] not in ((N_PIXELS,), IMAGE_SHAPE):
        raise DataError(
            f"{what}: images have shape {arr.shape}, expected (N, 28, 28) or (N, 784): {fix}"
        )


def check_labels(arr: np.ndarray, what: str, fix: str) -> None:
    """Refuse labels that are not a 1-D integer array of classes 0..9, naming the first bad one."""
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise DataError(
            f"{what}: labels must be a 1-D integer array, got {arr.dtype} {arr.shape}: {fix}"
        )
    bad = np.flatnonzero((arr < 0) | (arr >= N_CLASSES))
    if bad.size:
        raise DataError(
            f"{what}: labels must be in 0..9, found {int(arr[bad[0]])} at index {int(bad[0])} "
            f"({bad.size} out of range): {fix}"
        )
