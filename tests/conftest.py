"""Shared test set-up: where the fixtures are, and the GPU marker's skip rule."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _fixtures_dir() -> Path:
    # ../shared/fixtures beside the checkout (developers and CI); .fixtures/ inside it on the GPU machine,
    # where ../shared does not travel; STRATA_FIXTURES overrides both.
    for cand in (os.environ.get("STRATA_FIXTURES"), ROOT.parent / "shared" / "fixtures", ROOT / ".fixtures"):
        if cand and Path(cand).is_dir():
            return Path(cand)
    return ROOT.parent / "shared" / "fixtures"


FIXTURES = _fixtures_dir()


def gpu_available() -> tuple[bool, str]:
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        return (n > 0, "" if n > 0 else "CuPy finds no GPU")
    except Exception as e:  # ImportError, CUDARuntimeError, missing driver
        return False, f"no usable GPU through CuPy ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def pytest_collection_modifyitems(config, items):
    if not any("gpu" in item.keywords for item in items):
        return
    ok, why = gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {why}; these run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip(f"fixtures not found at {FIXTURES} (set STRATA_FIXTURES)")
    return FIXTURES
