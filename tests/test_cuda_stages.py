"""engine/cuda/stages.py's hand-off on a real GPU: stages on one device (the test mode of --gpus 0,0) and, where
CUDA shows two GPUs, across two. Fresh random data at several sizes, receive buffers poisoned (NaN) first."""
import numpy as np
import pytest

from engine.cuda import stages as st
from tiny_models import tiny_model

pytestmark = pytest.mark.gpu


def _devices():
    import cupy as cp
    n = cp.cuda.runtime.getDeviceCount()
    return [(0, 0)] + ([(0, 1)] if n > 1 else [])


def _streams(a, b):
    import cupy as cp
    with cp.cuda.Device(a):
        sa = cp.cuda.Stream(non_blocking=True)
    with cp.cuda.Device(b):
        sb = cp.cuda.Stream(non_blocking=True)
    return sa, sb


@pytest.mark.parametrize("rows,width", [(1, 64), (7, 2048), (512, 4096)])
def test_a_handoff_lands_each_chunk_in_alternating_buffers(rows, width):
    import cupy as cp
    rng = np.random.default_rng(rows * 31 + width)
    for a, b in _devices():
        sa, sb = _streams(a, b)
        h = st.Handoff(a, b, sa, sb, (rows, width), cp.float32)
        with cp.cuda.Device(b):
            for buf in h.bufs:
                buf.fill(np.nan)
            cp.cuda.Device(b).synchronize()
        with cp.cuda.Device(a), sa:
            src = cp.empty((rows, width), dtype=cp.float32)
        sent, got = [], []
        for c in range(3):
            x = rng.standard_normal((rows, width)).astype(np.float32)
            h.wait_landed()                 # the last chunk's copy read src: now it may be overwritten
            with cp.cuda.Device(a), sa:
                src.set(x, stream=sa)
                src *= 2                    # work on the sender's stream the copy must follow
            n = rows if c < 2 else max(1, rows // 2)
            dst = h.send(src, n)
            with cp.cuda.Device(b), sb:
                got.append(dst[:n].copy())      # on the receiver's stream, after the copy
            sent.append(2 * x[:n])
        with cp.cuda.Device(b):
            sb.synchronize()
            for want, g in zip(sent, got):
                np.testing.assert_array_equal(cp.asnumpy(g), want)
        assert h.bufs[0] is not h.bufs[1]


def test_three_stages_on_one_device_chain_by_events():
    """The hidden state through three stages on device 0, each adding its own vector on its own stream: the result
    is the sum, so each stage ran after the one before it."""
    import cupy as cp
    rng = np.random.default_rng(5)
    n = 4096
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
    hands = [st.Handoff(0, 0, streams[i], streams[i + 1], (n,), cp.float32) for i in range(2)]
    adds = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    with streams[0]:
        x = cp.asarray(adds[0])
        x = x * 1.0
    for i, hd in enumerate(hands):
        for buf in hd.bufs:
            buf.fill(np.nan)
        cp.cuda.Device(0).synchronize()
        x = hd.send(x)
        with streams[i + 1]:
            x += cp.asarray(adds[i + 1])
    streams[2].synchronize()
    np.testing.assert_allclose(cp.asnumpy(x), adds[0] + adds[1] + adds[2], rtol=1e-6, atol=1e-6)


def test_a_handoff_refuses_a_chunk_its_buffers_cannot_hold():
    import cupy as cp
    s = cp.cuda.Stream(non_blocking=True)
    h = st.Handoff(0, 0, s, s, (4, 8), cp.float32)
    with s:
        src = cp.zeros((5, 8), dtype=cp.float32)
    with pytest.raises(ValueError, match="hand-off of 5 rows"):
        h.send(src)
    with pytest.raises(ValueError, match="hand-off of 2 rows"):
        h.send(src.astype(cp.float16), 2)


# --- two (three) stages of the decode step on one device agree with the unsplit step ------------------------------

def _run(step, be, tokens, use_graph):
    """Teacher-forced decode from position 0 through `step` (the backend's DecodeStep or a StagedDecode): each
    position's greedy pick and logits. The recurrent state starts from zero; the K/V rows are rewritten in order."""
    if be.recurrent_state is not None:
        be.recurrent_state.zero()
    import cupy as cp
    cp.cuda.Device().synchronize()
    picks, logits = [], []
    for pos, tok in enumerate(tokens):
        step.launch(tok, pos, "greedy", use_graph)
        picks.append(step.pick_at(pos))
        with be.stream:
            logits.append(step.logits.get(stream=be.stream))
    return picks, np.stack(logits)


@pytest.mark.parametrize("family", ["moe", "hybrid", "gptoss"])
@pytest.mark.parametrize("cache", ["all", "part"])
def test_stages_on_one_device_agree_with_the_unsplit_step(family, cache, tmp_path, fixtures_dir):
    import cupy as cp

    from engine.cuda.backend import CUDABackend, CudaOptions
    from engine.cuda.staged_decode import StagedDecode
    model, prompt = tiny_model(family, tmp_path, fixtures_dir)
    cfg = model.config
    slots = None if cache == "all" else max(1, cfg.n_layer * cfg.n_expert // 3)
    # no prefetch: the staged steps have none (its staging slots would rewrite the shared cache's table mid-step)
    be = CUDABackend(model, 256, CudaOptions(pipeline=False, prefill_chunk=64, expert_slots=slots,
                                             adapt_every=0, prefetch=False))
    try:
        if cache == "part" and be.cache is not None:
            assert be.cache.n_slots < be.cache.n_total
        tokens = list(prompt[:12])
        n = cfg.n_layer
        splits = [[n // 2, n - n // 2]] + ([[1, n - 2, 1]] if n >= 3 else [])
        for use_graph in (False, True):
            ref_picks, ref_logits = _run(be.step, be, tokens, use_graph)
            assert np.isfinite(ref_logits).all()
            for counts in splits:
                specs = st.stage_specs([cp.cuda.Device().id] * len(counts), counts, n)
                staged = StagedDecode(be, specs)
                try:
                    assert [s.layers_run for s in staged.steps] == [s.layers for s in specs]
                    assert [s.embeds for s in staged.steps] == [True] + [False] * (len(counts) - 1)
                    assert [s.heads for s in staged.steps] == [False] * (len(counts) - 1) + [True]
                    if use_graph:
                        staged.capture()
                    picks, logits = _run(staged, be, tokens, use_graph)
                finally:
                    staged.close()
                assert picks == ref_picks, (counts, use_graph)
                # the same kernels on the same inputs; only the order of float atomics (expert sums) may differ
                scale = float(np.abs(ref_logits).max())
                np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4 * scale, err_msg=str(counts))
    finally:
        be.close()


def test_the_staged_decode_refuses_a_stage_on_another_device_or_a_gap(fixtures_dir, tmp_path):
    import cupy as cp

    from engine.cuda.backend import CUDABackend, CudaOptions
    from engine.cuda.staged_decode import StagedDecode
    model, _ = tiny_model("moe", tmp_path, fixtures_dir)
    n = model.config.n_layer
    be = CUDABackend(model, 128, CudaOptions(pipeline=False, prefill_chunk=64))
    try:
        here = cp.cuda.Device().id
        with pytest.raises(st.StageError, match=f"stage 1 is on GPU {here + 1}"):
            StagedDecode(be, st.stage_specs([here, here + 1], [1, n - 1], n))
        with pytest.raises(st.StageError, match="cover the model's layers"):
            StagedDecode(be, st.stage_specs([here], [n - 1], n - 1))
    finally:
        be.close()
