"""Qwen3.8-Flash-Next (qwen4exp) in the catalog (issue 29 item 6): the published files with their sizes, what each
needs (experts in pinned RAM, the n-gram table read by row from the disk), offered as a CUDA preview (issue 35)
where the PC fits them and never recommended while the CUDA backend runs the architecture as a preview only, and
recommended only where the PC fits them once it graduates."""
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


def test_offered_as_a_cuda_preview_where_the_pc_fits_it_never_recommended(catalog):
    """engine/supported.py lists qwen4exp as a CUDA preview: on a GPU it is runnable (the worker takes it with
    --backend cuda, which setup's config passes), fits where RAM and VRAM hold it, says it is a preview, and is never
    the automatic recommendation."""
    fitted = set()
    for profile, m in GOLDEN.items():
        for model in flash(catalog):
            n = assess(model, m)
            if m.gpus:
                assert n.supported and n.preview and n.backend == "cuda", profile
                assert n.warnings[0] == catalog_mod.PREVIEW_NOTE.format(arch="qwen4exp")
                assert not any(p.startswith("not supported yet") for p in n.problems), (profile, n.problems)
                if n.fits:
                    fitted.add((profile, model.recipe, n.mode))
            else:           # the CPU backend runs it, but not at this size
                assert not n.fits and not n.preview
                assert any(p.startswith("too large for the CPU backend") for p in n.problems), (profile, n.problems)
        assert recommend([assess(model, m) for model in catalog]).model.arch != "qwen4exp"
    # the published Q2_0 and IQ2_XS packs (31.1 and 32.6 GiB of experts, 7.8 GiB of VRAM at 32K): 24 GiB of their
    # experts pinned in the 27 GiB a 32 GiB PC lets Strata use (the rest read from the disk), all of them from 64 GiB
    # up; not on a disk with 12 GB free
    for recipe in ("Q2_0", "IQ2_XS"):
        assert {f for f in fitted if f[1] == recipe} == {("one_12gb_32gb", recipe, "budget"),
                                                       ("one_24gb_64gb", recipe, "ram"), ("two_cards", recipe, "ram")}


def test_a_preview_that_does_not_fit_says_why(catalog):
    small = machine((6,), 128)      # attention, HC and KV at 32K need ~7.8 GiB of VRAM
    n = assess(next(m for m in flash(catalog) if m.recipe == "Q2_0"), small)
    assert n.preview and not n.fits and any("GiB of VRAM" in p for p in n.problems)


@pytest.fixture()
def cuda_runs_qwen4exp(monkeypatch):
    """As setup will see it once engine/supported.py lists qwen4exp in CUDA_ARCHS (no longer a preview)."""
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
