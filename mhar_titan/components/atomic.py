"""The one way this project writes a small file that others read while it runs (fingerprints, checksums,
markers, validation records, run records, reports): whole or not at all, on disk before it is named."""

from __future__ import annotations

import os
import tempfile


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to a temporary file beside `path`, fsync it, then rename it over `path`. A reader sees the
    old file or the new one, never a part; a crash leaves the old one; two writers never share a temporary."""
    folder = os.path.dirname(os.fspath(path)) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(os.fspath(path))}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600: the mode `open` would have given, for teammates
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (racy only against threads creating files now)
    os.umask(mask)
    return mask
