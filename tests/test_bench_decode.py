"""bench/decode.py's host-side helpers (the GPU benches themselves run on the device machine)."""
from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import decode  # noqa: E402
from engine.cuda import backend as cuda_backend  # noqa: E402
from engine.cuda.trace import ChunkFacts  # noqa: E402


class _Backend:
    """Stands in for CUDABackend: keeps its tracer, as the real one does."""

    def __init__(self, model, ctx, opts, tracer=None):
        self.tracer, self.opts = tracer, opts


def test_fresh_backend_lets_go_of_the_last_backend_through_the_tracer(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_backend, "CUDABackend", _Backend)
    freed = []
    monkeypatch.setattr(decode, "free_vram", lambda: freed.append(gc.collect() >= 0))
    tracer = ChunkFacts()
    old = decode.fresh_backend(None, 64, "12", tmp_path / "p", tracer)
    tracer.prefill_chunk(dict(runner=old, ring=4))     # a chunk's facts: its runner reaches the backend
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is not None                          # the tracer keeps it alive...
    new = decode.fresh_backend(None, 64, "24", tmp_path / "p", tracer)
    assert tracer.last is None and gone() is None      # ...until the next backend is built, before free_vram
    assert freed and new.opts.vram_budget_mib == 24 * 1024 and new.tracer is tracer


def test_fresh_backend_without_a_tracer(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_backend, "CUDABackend", _Backend)
    monkeypatch.setattr(decode, "free_vram", lambda: None)
    be = decode.fresh_backend(None, 64, "all", tmp_path / "p")
    assert be.tracer is None and be.opts.vram_budget_mib is None


def test_touched_bytes_reads_a_token_s_ple_rows_not_the_table():
    """qwen4exp's n-gram table is read by row (one per PLE head a token), so the HBM ceiling counts those rows; every
    other non-expert tensor once, the embedding's one row, k experts a layer."""
    from engine.gguf_model import open_model
    model = open_model(Path(__file__).resolve().parent / "fixtures" / "qwen4exp" / "tiny-qwen4exp-q2_0.gguf")
    table = model.tensor("per_layer_token_embd.weight")
    heads = model.config.family_params.n_ple_heads
    assert heads == 16 and table.shape[0] > 4000
    rest = sum(model.tensor(n).nbytes for n in model.tensor_names()
               if "_exps." not in n and n not in ("per_layer_token_embd.weight", "token_embd.weight"))
    embd = model.tensor("token_embd.weight")
    want = rest + embd.nbytes // embd.shape[0] + (embd.nbytes if model.config.tied_embeddings else 0)
    want += heads * table.nbytes // table.shape[0] + model.config.n_layer * 2 * 1000
    assert decode.touched_bytes(model, 2, 1000) == want
