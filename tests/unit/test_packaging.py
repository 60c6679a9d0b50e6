"""Building the package from a fresh checkout (no generated stubs yet): no setuptools warning
(it warned that 'specsplit.v1' was absent from `packages` and installed the stubs as data), and
the wheel carries the stubs generated from proto/."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = ("tests/", "bench/")  # not packaged; keeps the copy small


def _fresh_checkout(dest: Path) -> None:
    """The tracked files as they are in the working tree: no specsplit/v1, no build output."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if name.startswith(SKIPPED) or not source.is_file():
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / name)


def test_building_the_wheel_prints_no_warning_and_ships_the_stubs(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    if shutil.which("git") is None:
        pytest.skip("needs git to list the tracked files")
    checkout = tmp_path / "checkout"
    _fresh_checkout(checkout)
    assert not (checkout / "specsplit" / "v1").exists()
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v"]
    done = subprocess.run(
        [*argv, "--no-index", ".", "-w", str(tmp_path / "dist")],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "specsplit.v1" not in output or "absent from" not in output, output[-3000:]
    assert "Warning" not in output, [line for line in output.splitlines() if "Warning" in line]
    (wheel,) = (tmp_path / "dist").glob("specsplit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for stub in ("gateway_pb2.py", "gateway_pb2_grpc.py", "drafter_pb2.py", "__init__.py"):
        assert f"specsplit/v1/{stub}" in names, stub
