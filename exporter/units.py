"""Byte counts as people read them."""


def size_text(num_bytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; GiB is the largest unit."""
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.2f} GiB"
