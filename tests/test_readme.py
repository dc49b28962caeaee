"""The README stays a user's page and in step with the code: short, its test command the one .ci/run runs, and every
file, module, config key and flag it names real."""
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
TEST_COMMAND = "python -m pip install -q -r requirements-test.txt && python -m pytest -q"


def test_short_enough_for_a_user():
    assert README.count("\n") < 150 and len(README.encode()) < 8000


def test_the_test_command_is_the_one_ci_runs():
    blocks = re.findall(r"```sh\n(.*?)```", README, re.S)
    assert blocks and blocks[0].splitlines() == ["python -m setup --yes", TEST_COMMAND]
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci[-1] == TEST_COMMAND


def test_linked_files_exist():
    for target in re.findall(r"\]\(([^)#:]+)\)", README):
        assert (ROOT / target).is_file(), target
    for path in re.findall(r"`((?:setup|server|engine|tools|data|bench)/[\w./]+)`", README):
        assert (ROOT / path).exists(), path


def test_modules_config_keys_and_flags_are_real():
    import importlib.util
    for mod in set(re.findall(r"python -m ([\w.]+)", README)) - {"pip", "pytest"}:
        assert importlib.util.find_spec(mod) is not None, mod
    from server.config import ServerConfig
    keys = {f.name for f in fields(ServerConfig)}
    settings = README.split("## Settings")[1].split("## ")[0]
    for row in re.findall(r"^\| (`.+?`) \|", settings, re.M):
        for key in re.findall(r"`(\w+)`", row):
            assert key in keys, key
    from strata_worker import build_parser
    worker_flags = set(build_parser()._option_string_actions)
    engine = settings.split("Engine flags")[1].split("Setup's own")[0]
    for flag in re.findall(r"`(--[\w-]+)", engine):
        assert flag in worker_flags, flag
    setup_help = subprocess.run([sys.executable, "-m", "setup", "--help"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60).stdout
    for flag in set(re.findall(r"python -m setup (--[\w-]+)", README)) | set(
            re.findall(r"`(--[\w-]+)", settings.split("Setup's own")[1])):
        assert re.search(rf"{re.escape(flag)}\b", setup_help), flag
