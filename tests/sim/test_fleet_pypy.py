"""The fleet simulator under PyPy decides exactly what it decides under CPython: the long runs
(docs/fleet-simulation.md, the 1M-request target) are timed there. PyPy comes from
scripts/ensure_pypy.sh (Debian's mirror and PyPI); the pinned-digest and stretch-exactness
tests then run under it, with pytest installed for it beside the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pypy() -> str:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "ensure_pypy.sh")], check=True,
                         capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, PYTHON=sys.executable))
    return out.stdout.strip().splitlines()[-1]


def _pytest_for(pypy: str) -> Path:
    """pytest (pure Python) installed where only `pypy` looks, next to its unpacked tree."""
    target = Path(pypy).resolve().parents[2] / "everystop-test-site"
    if not (target / "pytest").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", "--target", str(target), "pytest"],
                       check=True, timeout=600)
    return target


def test_pypy_runs_the_fleet_exactness_tests() -> None:
    pypy = _pypy()
    site = _pytest_for(pypy)
    assert subprocess.run([pypy, "-c", "import sys; assert sys.implementation.name == 'pypy'"],
                          timeout=60).returncode == 0
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{site}")
    run = subprocess.run(
        [pypy, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
         "tests/sim/test_fleet_pinned.py", "tests/sim/test_decode_stretch.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout and "skipped" not in run.stdout
