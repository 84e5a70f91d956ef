"""Test helper: write small idx files (the MNIST/Fashion-MNIST format) for the data loaders' tests."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np


def write_idx(path: Path, array: np.ndarray, compress: bool = False) -> None:
    """idx format: 0x00 0x00, type 0x08 (uint8), ndim, big-endian int32 dims, then the data
    (written independently of flwr_sheaf.data.sources, which reads it); ``compress`` writes
    ``<path>.gz``."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(">" + "i" * array.ndim, *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        Path(path).write_bytes(data)
