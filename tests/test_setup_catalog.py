"""The catalog and the fit arithmetic on golden machines (no network, no GPU: machine facts are injected)."""
import dataclasses
import json

import pytest

from engine.supported import CUDA_ARCHS, CUDA_PREVIEW_ARCHS, SUPPORTED_ARCHS, runs_on
from setup.catalog import (GIB, CatalogError, assess, best_gpu, find_model, load_catalog, memory_mode, model_from_gguf,
                           ram_budget, recommend, split_parts)
from setup.machine import GPU, Machine

GB = 10 ** 9


def machine(gpus=(), ram_gib=32, disk_gb=500):
    return Machine(gpus=[GPU(i, f"Test GPU {v} GB", v * 1024, v * 1024 - 300) for i, v in enumerate(gpus)],
                   driver="560.1" if gpus else None, cuda="12.6" if gpus else None,
                   gpu_note="" if gpus else "nvidia-smi not found", ram_total=ram_gib * GIB,
                   ram_available=int(ram_gib * GIB * 0.8), cpu="Test CPU", cpu_cores=8, disk_free=disk_gb * GB,
                   disk_path="/models", os="Linux")


GOLDEN = {
    "no_gpu": machine((), 16),
    "one_12gb_32gb": machine((12,), 32),
    "one_24gb_64gb": machine((24,), 64),
    "two_cards": machine((24, 24), 128),
    "low_disk": machine((24,), 64, disk_gb=12),
}

EXPECTED = {
    "no_gpu": "smollm2-135m",
    "one_12gb_32gb": "qwen3-30b-a3b-q6_k",
    "one_24gb_64gb": "qwen3-30b-a3b-q8_0",
    "two_cards": "qwen3-235b-a22b-q2_k",
    "low_disk": "smollm2-135m",
}


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_catalog_is_complete_and_honest(catalog):
    for m in catalog:
        assert m.arch and m.recipe, m.name           # every entry names its architecture and recipe
        assert m.files and m.size > 0
        assert m.size_note, m.name
        for f in m.files:
            assert f.sha256 is None or len(f.sha256) == 64
        if m.source == "hf":
            assert m.repo and m.revision
        if len(m.files) > 1:   # split sets list every part, first part first
            assert f"-00001-of-{len(m.files):05d}.gguf" in m.files[0].name
    assert find_model(catalog, "smollm2-135m").source == "pypi"


def test_every_entry_is_checked_against_the_engines_architectures(catalog):
    """'runs' is the engine's own list (engine/supported.py, what open_model checks): an entry is offered as runnable
    exactly when its architecture is on it (on the GPU: CUDA_ARCHS, or CUDA_PREVIEW_ARCHS offered as a preview), and
    each one that runs is a family the engine builds a forward for."""
    from engine.arch import family
    from engine.gguf_model import SUPPORTED_ARCHS as OPEN_MODEL_ARCHS
    assert OPEN_MODEL_ARCHS is SUPPORTED_ARCHS
    big = machine((80,), 1024, disk_gb=10 ** 4)
    runs = [m for m in catalog if m.supported]
    assert {m.arch for m in runs} <= set(SUPPORTED_ARCHS)
    assert len([m for m in runs if m.is_moe and m.arch in CUDA_ARCHS]) >= 6   # the MoE models people offload today
    for m in catalog:
        n = assess(m, big)                                  # a GPU: the CUDA backend's list decides
        if m.arch in CUDA_ARCHS or m.arch in CUDA_PREVIEW_ARCHS:
            assert n.fits and not any("not supported" in p for p in n.problems), (m.name, n.problems)
            assert n.preview == (m.arch not in CUDA_ARCHS), m.name
            assert family(m.arch, m.is_moe) is not None, m.name
        else:
            assert not n.fits and not n.supported and any(
                f"not supported yet: this engine does not run the {m.arch}" in p for p in n.problems), m.name


def test_open_model_refuses_exactly_what_the_catalog_calls_unsupported(tmp_path, catalog):
    """A GGUF naming each catalog architecture: open_model's refusal ("does not run yet") comes for the ones the
    catalog lists as not supported yet, and never for the others (they fail later, on the missing tensors)."""
    import gguf
    import numpy as np
    from engine.gguf_model import ModelError, open_model
    for arch in sorted({m.arch for m in catalog}):
        path = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(ModelError) as e:
            open_model(path)
        refused = "does not run yet" in str(e.value)
        assert refused == (arch not in SUPPORTED_ARCHS), (arch, str(e.value))


def test_unsupported_entries_are_never_recommended(catalog):
    for profile, m in GOLDEN.items():
        backend = "cuda" if m.has_gpu else "cpu"
        boosted = [dataclasses.replace(mod, preference=1000) if not runs_on(mod.arch, backend) else mod
                   for mod in catalog]
        rec = recommend([assess(model, m) for model in boosted])
        assert rec.supported and rec.model.name == EXPECTED[profile], profile


@pytest.mark.parametrize("profile", sorted(GOLDEN))
def test_golden_machines_get_the_expected_recommendation(catalog, profile):
    m = GOLDEN[profile]
    rows = [assess(model, m) for model in catalog]
    rec = recommend(rows)
    assert rec.model.name == EXPECTED[profile]
    assert rec.fits


def test_no_gpu_marks_every_large_model_as_needing_one(catalog):
    rows = {n.model.name: n for n in (assess(model, GOLDEN["no_gpu"]) for model in catalog)}
    assert rows["smollm2-135m"].backend == "cpu" and rows["smollm2-135m"].fits
    for name, n in rows.items():
        if name != "smollm2-135m":
            assert not n.fits and any("NVIDIA GPU" in p for p in n.problems), name


def test_12gb_card_and_32gb_ram(catalog):
    m = GOLDEN["one_12gb_32gb"]
    q4 = assess(find_model(catalog, "qwen3-30b-a3b-q4_k_m"), m)
    assert q4.fits and q4.mode == "ram" and q4.backend == "cuda"
    assert q4.vram_need < 12 * GIB
    q8 = assess(find_model(catalog, "qwen3-30b-a3b-q8_0"), m)
    # fits (VRAM, disk) but its experts do not all fit in RAM: a RAM budget, said as a warning
    assert q8.fits and q8.mode == "budget" and 2 <= q8.resident_gib < 28
    assert any("read from the disk" in w for w in q8.warnings)
    big = assess(find_model(catalog, "qwen3-235b-a22b-q4_k_m"), m)
    assert not big.fits and any("VRAM" in p for p in big.problems)
    # a smaller context shrinks the KV, which is what the message suggests
    assert assess(find_model(catalog, "qwen3-235b-a22b-q4_k_m"), m, ctx=4096).vram_need < big.vram_need


def test_vram_is_judged_per_card(catalog):
    """The worker runs on one GPU: two 12 GB cards are not a 24 GB one; the larger card of a pair is the one used."""
    model = find_model(catalog, "qwen3-235b-a22b-q4_k_m")
    one = assess(model, machine((12,), 256))
    two = assess(model, machine((12, 12), 256))
    assert not one.fits and not two.fits and two.vram_have == 12 * GIB
    assert any("cards do not add up" in p for p in two.problems)
    mixed = assess(model, machine((12, 24), 256))
    assert mixed.fits and mixed.vram_have == 24 * GIB
    assert best_gpu(machine((12, 24, 24), 256)).index == 1


def test_low_disk_says_how_much_is_needed(catalog):
    n = assess(find_model(catalog, "qwen3-30b-a3b-q4_k_m"), GOLDEN["low_disk"])
    assert not n.fits
    assert any("18.6 GB of disk" in p and "12.0 GB free" in p for p in n.problems)
    # bytes already downloaded count: with most of it here the rest fits
    n2 = assess(find_model(catalog, "qwen3-30b-a3b-q4_k_m"), GOLDEN["low_disk"], already=10 * GB)
    assert n2.fits and n2.download == 18_556_685_824 - 10 * GB


def test_memory_modes_from_ram_vs_experts():
    assert memory_mode(10 * GIB, 20 * GIB) == ("ram", 0)
    mode, n = memory_mode(40 * GIB, 20 * GIB)
    assert mode == "budget" and n == 18
    assert memory_mode(200 * GIB, 10 * GIB) == ("mmap", 0)     # 8 GiB of 200 is below a useful share
    assert ram_budget(machine((), 16)) == 12 * GIB              # 4 GiB kept for the system
    assert ram_budget(machine((), 128)) == 128 * GIB - int(0.15 * 128 * GIB)   # 15% kept on a big PC


def test_gguf_measured_from_its_tensor_table(fixtures_dir):
    moe = model_from_gguf(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf")
    assert moe.arch == "qwen3moe" and moe.is_moe and 0.3 < moe.expert_share < 1
    assert moe.kv_bytes_per_token > 0
    dense = model_from_gguf(fixtures_dir / "reference" / "tiny-llama-legacy.gguf")
    assert dense.expert_share == 0 and not dense.is_moe


def test_split_sets_and_bad_files(tmp_path):
    for i in (1, 2):
        (tmp_path / f"m-{i:05d}-of-00003.gguf").write_bytes(b"GGUF")
    with pytest.raises(CatalogError, match="missing m-00003-of-00003.gguf"):
        split_parts(tmp_path / "m-00001-of-00003.gguf")
    (tmp_path / "m-00003-of-00003.gguf").write_bytes(b"GGUF")
    assert len(split_parts(tmp_path / "m-00001-of-00003.gguf")) == 3
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(CatalogError, match="not a readable GGUF"):
        model_from_gguf(tmp_path / "bad.gguf")


def test_bad_catalog_is_named(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"models": [{"name": "x", "files": [], "bogus": 1}]}))
    with pytest.raises(CatalogError, match="catalog entry x"):
        load_catalog(p)
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog(tmp_path / "none.json")


def test_machine_round_trips_through_a_dict():
    m = GOLDEN["two_cards"]
    assert Machine.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    with pytest.raises(ValueError, match="unknown machine fields: vram"):
        Machine.from_dict({"vram": 1})
