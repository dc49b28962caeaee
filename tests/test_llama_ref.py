"""tools.llama_ref's own parts that need no llama.cpp: prompts, the comparison, importance matrices."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from tools import imatrix as im
from tools import llama_ref as lr
from tools import make_moe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "tiny.gguf"
    make_moe.main(["--preset", "tiny", "--n-layer", "2", "--n-expert", "4", "--threads", "1", *lr.F16_TYPES,
                   "--out", str(path)])
    return path


def test_prompts_are_deterministic_and_in_the_vocabulary():
    a, b = lr.prompts(1024, seed=3), lr.prompts(1024, seed=3)
    assert a == b and [len(p) for p in a] == [8, 24, 40] and all(0 <= t < 1024 for p in a for t in p)
    assert lr.prompts(1024, seed=4) != a


def test_compare_reads_llama_cpp_and_exact_columns():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((2, 50))
    steps = []
    for r in rows:
        top = np.argsort(-r)[:10]
        steps.append({"top": [[int(i), float(r[i]) + 0.1] for i in top], "margin": float(r[top[0]] - r[top[1]]),
                      "exact_top": [[int(i), float(r[i])] for i in top], "exact_at_top": [float(r[i]) for i in top]})
    ref = {"cases": [{"steps": steps}]}
    c = lr.compare(ref, [rows])
    assert c.vs_exact_median == pytest.approx(0) and c.vs_llama_median == pytest.approx(0.1)
    assert c.vs_llama_over1 == 0 and c.top1_agree == c.top1_clear
    c = lr.compare(ref, [rows + 2.0])
    assert c.vs_exact_median == pytest.approx(2) and c.vs_llama_over1 == 1


def test_imatrix_sums_each_expert_over_the_tokens_routed_to_it(tiny, tmp_path):
    m = im.compute_imatrix(tiny, [[1, 2, 3, 4, 5], [6, 7, 8]])
    assert m.n_tokens == 8
    q = m.stats["blk.0.attn_q.weight"]
    assert q.counts.tolist() == [8] and q.sums.shape == (1, 256) and (q.sums > 0).all()
    gate = m.stats["blk.1.ffn_gate_exps.weight"]
    assert gate.sums.shape == (4, 256) and gate.counts.sum() == 8 * 2      # 2 experts used per token
    down = m.stats["blk.1.ffn_down_exps.weight"]
    assert np.array_equal(down.counts, gate.counts) and down.sums.shape == (4, 256)
    unused = gate.counts == 0
    assert np.all(gate.means()[unused] == 1.0)    # as llama-quantize loads a GGUF imatrix
    # the exchange file tools/llama_worker.py reads
    data = im.write_imatrix(tmp_path / "x.imatrix", m).read_bytes()
    (n,) = struct.unpack_from("<I", data, 0)
    name = data[4:4 + n].decode()
    (count,) = struct.unpack_from("<Q", data, 4 + n)
    first = np.frombuffer(data, "<f4", count, 12 + n)
    np.testing.assert_allclose(first, m.stats[name].means().reshape(-1), rtol=1e-6)
    # llama-imatrix's own GGUF format
    r = gguf.GGUFReader(im.write_gguf_imatrix(tmp_path / "x.gguf", m))
    t = {x.name: x for x in r.tensors}
    assert list(t["blk.1.ffn_gate_exps.weight.in_sum2"].shape) == [256, 4]
    np.testing.assert_array_equal(np.asarray(t["blk.1.ffn_gate_exps.weight.counts"].data).reshape(-1),
                                  gate.counts.astype(np.float32))
    assert bytes(r.fields["general.type"].parts[-1]).decode() == "imatrix"


def test_unknown_recipe_and_missing_imatrix_are_refused(tiny, tmp_path):
    with pytest.raises(lr.LlamaRefError, match="unknown recipe"):
        lr.quantize(tiny, tmp_path / "x.gguf", "q4_k_xl")
    with pytest.raises(lr.LlamaRefError, match="needs an importance matrix"):
        lr.quantize(tiny, tmp_path / "x.gguf", "iq2_xxs")


def test_a_missing_wheel_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.delenv("STRATA_LLAMA_PYTHON", raising=False)
    with pytest.raises(lr.LlamaRefError, match="STRATA_LLAMA_PYTHON"):
        lr.llama_python(wheel=tmp_path / "none.whl", cache=tmp_path / "cache")


def test_llama_cpp_round_trip(tiny, tmp_path):
    why = lr.available()
    if why:
        pytest.skip(f"needs llama.cpp's CPU wheel: {why}")
    ref = lr.reference(tiny, lr.prompts(1024, seed=0, lengths=(6,)), n_predict=3)
    assert ref["llama_vs_exact"]["median_abs_diff"] < 0.05        # F16: llama.cpp is nearly exact
    case = ref["cases"][0]
    assert len(case["greedy_ids"]) == 3 and case["greedy_ids"][0] == case["steps"][0]["top"][0][0]
    q = lr.quantize(tiny, tmp_path / "q.gguf", "q4_k_m")
    assert lr.planned_types(tiny, "q4_k_m") == lr.tensor_types(q)   # the dry run says what the real run writes
    assert lr.sha256(lr.quantize(tiny, tmp_path / "q2.gguf", "q4_k_m")) == lr.sha256(q)   # deterministic
