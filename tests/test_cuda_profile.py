"""Expert profiles (docs/design.md "Files"): the .bin format round-trips, partial or foreign files are refused with a clear
message, and saving is atomic (no GPU needed)."""
import numpy as np
import pytest

from engine.profile import ProfileError, from_flat, load_profile, save_profile


def test_round_trip_and_ranks(tmp_path):
    rng = np.random.default_rng()
    flat = rng.permutation(48 * 128)[:1000]
    prof = from_flat(48, 128, flat)
    p = tmp_path / "x.bin"
    save_profile(p, prof)
    back = load_profile(p, 48, 128)
    np.testing.assert_array_equal(back.flat_order(), flat)
    r = back.ranks()
    assert r[flat[0]] == 0 and r[flat[-1]] == 999 and (r >= 0).sum() == 1000
    assert p.read_bytes()[:4] == b"STRP" and len(p.read_bytes()) == 24 + 4 * 1000 + 4 * 48 * 128
    assert [f.name for f in tmp_path.iterdir()] == ["x.bin"]      # no temporary left behind


@pytest.mark.parametrize("damage,needle", [
    (lambda b: b[:-1], "truncated"),
    (lambda b: b"GGUF" + b[4:], "not a Strata expert profile"),
    (lambda b: b[:4] + (2).to_bytes(4, "little") + b[8:], "version 2"),
])
def test_damaged_files_are_refused(tmp_path, damage, needle):
    p = tmp_path / "x.bin"
    save_profile(p, from_flat(4, 8, [3, 9, 31]))
    p.write_bytes(damage(p.read_bytes()))
    with pytest.raises(ProfileError, match=needle):
        load_profile(p, 4, 8)


def test_profile_of_another_model_is_refused(tmp_path):
    p = tmp_path / "x.bin"
    save_profile(p, from_flat(4, 8, [1, 2]))
    with pytest.raises(ProfileError, match="made for 4 layers x 8 experts"):
        load_profile(p, 48, 128)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.bin")


def test_a_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "x.bin"
    save_profile(p, from_flat(4, 8, [1, 2]))
    old = p.read_bytes()
    import os
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        save_profile(p, from_flat(4, 8, [5, 6, 7]))
    assert p.read_bytes() == old
    assert [f.name for f in tmp_path.iterdir()] == ["x.bin"]


def test_ranking_an_expert_twice_is_refused():
    with pytest.raises(ValueError):
        from_flat(4, 8, [1, 1])
