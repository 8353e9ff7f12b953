"""A small generated image (PNG) and audio clip (16-bit PCM WAV), written with the standard library:
what ``check`` feeds a multimodal package, and what the tests feed ONNX Runtime GenAI's processor."""

from __future__ import annotations

import struct
import wave
import zlib
from pathlib import Path

import numpy as np


def write_png(path: Path, rgb: np.ndarray) -> Path:
    """``rgb``: [height, width, 3] values in 0-255."""
    height, width, _ = rgb.shape
    pixels = np.clip(rgb, 0, 255).astype(np.uint8)
    rows = b"".join(b"\x00" + pixels[row].tobytes() for row in range(height))  # filter type 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
                           + chunk(b"IEND", b""))
    return Path(path)


def write_wav(path: Path, samples: np.ndarray, sampling_rate: int = 16000) -> Path:
    """``samples``: mono, in -1..1."""
    with wave.open(str(path), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(sampling_rate)
        file.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return Path(path)


def gradient_image(height: int = 120, width: int = 200, seed: int = 0) -> np.ndarray:
    """Colour gradients plus a little noise: an image whose patches all differ."""
    rows, columns = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(seed).integers(0, 32, (height, width, 3))
    return np.stack([columns * 255 / width, rows * 255 / height, (rows + columns) % 256], -1) + noise


def tone(seconds: float = 1.3, frequency: float = 440.0, sampling_rate: int = 16000, seed: int = 0) -> np.ndarray:
    """A sine tone with a little noise."""
    time = np.arange(int(sampling_rate * seconds)) / sampling_rate
    noise = np.random.default_rng(seed).standard_normal(time.size)
    return 0.4 * np.sin(2 * np.pi * frequency * time) + 0.05 * noise
