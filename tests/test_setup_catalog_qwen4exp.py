"""Qwen3.8-Flash-Next (qwen4exp) in the catalog (issue 29 item 6): the published files with their sizes, what each
needs (experts in pinned RAM, the n-gram table read by row from the disk), "not supported yet" while the CUDA
backend does not run the architecture, and recommended only where the PC fits them once it does."""
from pathlib import Path

import pytest

import setup.catalog as catalog_mod
from setup.catalog import GIB, TABLE_ROW_CACHE, WORKER_OVERHEAD, assess, load_catalog, model_from_gguf, recommend
from test_setup_catalog import GOLDEN, machine

PUBLISHED_GB = {"Q2_0": 66.4, "IQ2_XS": 68.0, "IQ3_XXS": 75.8, "IQ3_S": 83.6, "UD-Q4_K_XL": 111.3}
TINY = Path(__file__).resolve().parent / "fixtures" / "qwen4exp" / "tiny-qwen4exp-f16.gguf"


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def flash(catalog):
    return [m for m in catalog if m.arch == "qwen4exp"]


def test_the_published_files_are_listed(catalog):
    entries = flash(catalog)
    assert {m.recipe: m.size / 1e9 for m in entries} == PUBLISHED_GB
    for m in entries:
        assert m.repo == "unsloth/Qwen3.8-Flash-Next-GGUF" and m.is_moe and not m.size_exact
        assert 0 < m.table_share and m.expert_share + m.table_share < 1, m.name
        # the estimate in size_note: the same table and dense bytes in every file, the experts the rest
        table, dense = m.size * m.table_share, m.size * (1 - m.expert_share - m.table_share)
        assert abs(table - 27.2e9) < 0.1e9 and abs(dense - 5.8e9) < 0.1e9, m.name
        assert m.kv_bytes_per_token == 12 * (2 * 2 * 256 + 128) * 2      # K, V and the indexer's keys, f16


def test_not_supported_yet_and_never_recommended_today(catalog):
    for profile, m in GOLDEN.items():
        for model in flash(catalog):
            n = assess(model, m)
            assert not n.fits
            if m.gpus:      # the CUDA backend does not run qwen4exp yet
                assert not n.supported
                assert any(p.startswith("not supported yet") for p in n.problems), (profile, n.problems)
            else:           # the CPU backend runs it, but not at this size
                assert any(p.startswith("too large for the CPU backend") for p in n.problems), (profile, n.problems)
        assert recommend([assess(model, m) for model in catalog]).model.arch != "qwen4exp"


@pytest.fixture()
def cuda_runs_qwen4exp(monkeypatch):
    """As setup will see it once engine/supported.py lists qwen4exp for the CUDA backend."""
    real = catalog_mod.runs_on
    monkeypatch.setattr(catalog_mod, "runs_on", lambda arch, backend: arch == "qwen4exp" or real(arch, backend))


def test_needs_leave_the_table_on_the_disk(catalog, cuda_runs_qwen4exp):
    m = machine((12,), 64)
    for model in flash(catalog):
        n = assess(model, m)
        assert n.table_bytes == int(model.size * model.table_share)
        assert n.dense_bytes == model.size - n.expert_bytes - n.table_bytes     # VRAM: no experts, no table
        assert n.vram_need < 9 * GIB
        if n.mode == "ram":
            assert n.ram_need == n.expert_bytes + WORKER_OVERHEAD + TABLE_ROW_CACHE
        assert n.ram_need < model.size - n.table_bytes
        assert any("n-gram table stays on the disk" in w for w in n.warnings)


@pytest.mark.parametrize("gpus,ram_gib,want", [
    ((12,), 32, None),                                  # no file's experts fit in 27 GiB of RAM
    ((12,), 64, "qwen3.8-flash-next-iq3_s"),            # 54 GiB usable: IQ3_S's 49.6 GiB, not UD-Q4_K_XL's 75.5
    ((24,), 128, "qwen3.8-flash-next-ud-q4_k_xl"),
    ((6,), 128, None),                                  # attention, HC and KV at 32K need ~7.8 GiB of VRAM
])
def test_recommended_only_where_the_pc_fits_it(catalog, cuda_runs_qwen4exp, gpus, ram_gib, want):
    m = machine(gpus, ram_gib)
    rows = [assess(model, m) for model in catalog]
    rec = recommend(rows)
    if want is None:
        assert rec.model.arch != "qwen4exp"
    else:
        assert rec.model.name == want and rec.fits and rec.mode == "ram" and rec.ram_need <= rec.ram_budget
    for n in rows:
        if n.model.arch == "qwen4exp" and n.model.preference > rec.model.preference:
            assert not n.fits or n.mode != "ram", n.model.name   # a better one was passed over only for not fitting


def test_a_qwen4exp_file_on_disk_is_measured(cuda_runs_qwen4exp):
    mod = model_from_gguf(TINY)
    assert mod.arch == "qwen4exp" and mod.is_moe
    assert mod.table_share == pytest.approx(16 * 4864 * 2 / TINY.stat().st_size)   # per_layer_token_embd, F16
