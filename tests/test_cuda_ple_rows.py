"""The prompt pass's n-gram rows on the GPU (engine/cuda/families/qwen4exp.py Q4Prompt.begin_chunk): a chunk's raw
rows gathered by engine/row_cache.py (ahead on a worker: engine/row_ahead.py), uploaded raw and dequantized by
dense.cu's dequant_rows, are bit for bit the host's dequantized rows (engine/quant_types.dequantize, the NumPy
reference); a prompt read with the next chunk named ahead gives the same logits as one read without."""
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.row_cache import RowCache  # noqa: E402
from tests.test_row_cache import table  # noqa: E402

HERE = Path(__file__).resolve().parent / "fixtures" / "qwen4exp"
# the n-gram table's types whose blocks fit its 160-wide rows (and the float ones)
TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.MXFP4)


@pytest.mark.parametrize("n", [1, 16, 16 * 37, 16 * 4096])
@pytest.mark.parametrize("qtype", TYPES)
def test_dequant_rows_of_gathered_rows_are_the_hosts(tmp_path, qtype, n):
    from engine.cuda import kernels
    t = table(tmp_path, qtype, 5000, 160, seed=n)
    rows = RowCache(t, 1 << 20)
    ids = np.random.default_rng(n).integers(0, 5000, n)
    raw = rows.raw(ids)
    want = rows.rows(ids)
    fn = kernels.load("dense", qtypes=[int(qtype)]).get_function(f"dequant_rows<{int(qtype)}>")
    dev = cp.asarray(raw.reshape(-1))
    out = cp.full((n, 160), cp.nan, dtype=cp.float32)
    blocks = max(1, min(4096, (n * 160 // 8 + 255) // 256))
    fn((blocks,), (256,), (dev, np.int64(rows.row_bytes), out, np.int32(n), np.int32(160)))
    got = out.get()
    assert np.isfinite(got).all()
    # bit for bit, but for the sign of zero: MXFP4's code 8 is -0.0 on the GPU, +0.0 from the host's dequantize
    np.testing.assert_array_equal((got + 0.0).view(np.uint32), (want + 0.0).view(np.uint32))
    rows.close()


@pytest.mark.parametrize("recipe", ["f16", "iq2_xs"])
def test_a_prompt_read_with_its_rows_ahead_is_the_prompt_read_without(recipe):
    """Chunks of 8: with read_ahead (the session's hint; the backend's own next chunk) every chunk after the first
    takes its rows from the worker; the logits, the last chunk's eta and the row counts are the same as a read with
    no gather ahead, whose eta is the host's ple_rows."""
    from engine.cuda.families.qwen4exp import ple_rows
    from engine.gguf_model import open_model
    from test_cuda_qwen4exp import cuda_backend, prompts
    model = open_model(HERE / f"tiny-qwen4exp-{recipe}.gguf")
    prompt = prompts(recipe)["long"]
    p = model.config.family_params
    got = []
    for hint in (False, True):
        be = cuda_backend(model)
        try:
            be.reset_stats()
            logits = []
            for i in range(0, len(prompt), 8):
                if hint and i + 8 < len(prompt):
                    be.read_ahead(prompt[i + 8:i + 16])
                logits.append(be.forward(prompt[i:i + 8], all_logits=True))
            prog = be.prefill.layers
            eta = cp.asnumpy(prog.eta)
            got.append((np.concatenate(logits), eta, be.request_info(), prog.ahead.taken_ahead))
        finally:
            be.close()
    (lg0, eta0, info0, ahead0), (lg1, eta1, info1, ahead1) = got
    np.testing.assert_array_equal(lg0, lg1)
    np.testing.assert_array_equal(eta0, eta1)
    assert info0 == info1 and info0["ple_row_lookups"] == 16 * len(prompt)
    assert ahead0 == 0 and ahead1 == -(-len(prompt) // 8) - 1
    # the last chunk's eta is the host's embedding of its tokens
    from engine.arch import qwen4exp as ref
    rows = RowCache(model.tensor(ref.PLE_TABLE), 1 << 16)
    try:
        last = (len(prompt) - 1) // 8 * 8
        before = np.array(([p.ple_eos] * (p.ngram_size - 1) + prompt[:last])[-(p.ngram_size - 1):], np.int64)
        want, _ = ple_rows(p, rows, prompt[last:], before)
        np.testing.assert_array_equal(eta0, want)
    finally:
        rows.close()


def test_the_backends_own_next_chunk_is_gathered_ahead():
    """One forward() of a prompt longer than a chunk: the backend names each next chunk itself."""
    from engine.gguf_model import open_model
    from test_cuda_qwen4exp import cuda_backend, prompts
    model = open_model(HERE / "tiny-qwen4exp-iq2_xs.gguf")
    prompt = prompts("iq2_xs")["long"]
    be = cuda_backend(model)
    try:
        be.forward(prompt)
        assert be.prefill.layers.ahead.taken_ahead == -(-len(prompt) // 8) - 1
    finally:
        be.close()
