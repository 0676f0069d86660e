"""Output paths that cannot be written, for the convert and truncate-model output checks.

Shared by tests/test_convert.py and test_truncate_model.py (both commands check their output path
the same way; tests/conftest.py puts tests/ on sys.path).
"""

from __future__ import annotations

from pathlib import Path

# "directory": the path is a directory; "under-file": its parent is a regular file;
# "under-file-deeper": a regular file sits two levels up.
UNWRITABLE = ("directory", "under-file", "under-file-deeper")


def unwritable_output(tmp_path: Path, where: str, name: str) -> tuple[Path, Path, str]:
    """Make the obstacle for case `where` under tmp_path.

    Returns (obstacle, output path, text the error must hold); a file obstacle holds "keep me".
    """
    blocker = tmp_path / "out"
    if where == "directory":
        blocker.mkdir()
        return blocker, blocker, "is a directory"
    blocker.write_text("keep me")
    path = blocker / name if where == "under-file" else blocker / "sub" / name
    return blocker, path, f"{blocker} is not a directory"
