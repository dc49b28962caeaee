"""qwen4exp's n-gram table is never loaded: a table several times the process's memory limit is read by rows while
RSS stays put (engine/row_cache.py reads rows by positioned reads; nothing maps, copies or dequantizes the table).

The model is tiny-qwen4exp with a 6 GiB table (hash heads of ~12M rows, so its rows spread over all of it) left as
a sparse hole in the file: every row reads as zeros, and the file takes no disk. The reading runs in a subprocess
whose RLIMIT_DATA (heap and private mappings) is 1 GiB: a copy of the table there fails outright, and RSS,
measured with psutil before and after tens of thousands of row reads across the table, must not grow by more than
the row cache's bound.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

from tools import hybrid_plan, make_moe

ROOT = Path(__file__).resolve().parent.parent
TABLE_GIB = 6
LIMIT_GIB = 1


def write_with_hole_table(path: Path, ple_rows: int) -> int:
    """tiny-qwen4exp with --ple-rows ple_rows, every tensor written but the n-gram table (the file's last), which
    is left as a hole. Returns the table's bytes."""
    args = make_moe.parse_args(["--preset", "tiny-qwen4exp", "--ple-rows", str(ple_rows), "--ple", "F32"])
    shape = make_moe.resolve_shape(args)
    vocab = hybrid_plan.adjust_vocab(make_moe.read_vocab(make_moe._resolve_vocab(shape.vocab)), shape.q4exp)
    n_vocab = next(len(v) for k, v, _ in vocab if k == "tokenizer.ggml.tokens")
    types = {g: getattr(args, g) for g in ("experts", "shexp", "attn", "ffn", "embd", "output", "norm", "hc", "ple")}
    specs = make_moe.plan(shape, types, n_vocab)
    assert specs[-1].name == "per_layer_token_embd.weight"
    w = gguf.GGUFWriter(path, shape.arch)
    make_moe.add_metadata(w, shape, "rss-check", types["experts"], vocab, None)
    for t in specs:
        w.add_tensor_info(t.name, (*t.shape[:-1], make_moe.row_bytes(t.qtype, t.shape[-1])), np.dtype(np.uint8),
                          t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, t in enumerate(specs[:-1]):
        w.write_tensor_data(make_moe.tensor_bytes(t, i, shape, 0, 1.0))
    f = w.fout[0]
    f.flush()
    f.truncate(f.tell() + specs[-1].nbytes)
    f.close()
    return specs[-1].nbytes


CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np, psutil
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    from engine.gguf_model import open_model
    from engine.backend_cpu import CPUBackend
    from engine.arch.qwen4exp import PLE_TABLE
    me = psutil.Process()
    m = open_model(sys.argv[1])
    table = m.tensor(PLE_TABLE)
    be = CPUBackend(m, 2048)                     # warm: every dense weight dequantized, the table not
    rng = np.random.default_rng(0)
    be.forward(rng.integers(0, 1000, 64).tolist())
    before = me.memory_info().rss
    be.truncate(0)
    be.forward(rng.integers(0, 1000, 1500).tolist())           # 24,000 rows through the forward
    rows = be.net.ple_rows
    got = rows.rows(rng.integers(0, table.shape[0], 40_000))   # and 40,000 more anywhere in the table
    after = me.memory_info().rss
    try:                                                        # a copy of the table cannot happen here at all
        np.array(table.data[: table.data.shape[0] // 2])
        copied = True
    except MemoryError:
        copied = False
    print(json.dumps({"before": before, "after": after, "lookups": rows.lookups, "slab": rows.nbytes,
                      "zeros": bool(np.all(got == 0)), "table": int(table.nbytes), "copied": copied}))
""")


@pytest.fixture(scope="module")
def big_table_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4exp_rss") / "tiny-qwen4exp-6gib-table.gguf"
    row = 16 * 4                                   # 16 F32 values
    nbytes = write_with_hole_table(path, TABLE_GIB * 2**30 // row)
    assert nbytes > (TABLE_GIB - 0.01) * 2**30
    yield path
    path.unlink()


def test_a_table_six_times_the_memory_limit_is_read_without_rss_growing(big_table_model):
    limit = LIMIT_GIB * 2**30
    p = subprocess.run([sys.executable, "-c", CHILD, str(big_table_model), str(limit)], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["table"] >= TABLE_GIB * limit * 0.99 and not r["copied"]
    assert r["zeros"] and r["lookups"] >= 16 * 1500 + 40_000
    # rows come through the slab (at most its size of new pages) and nothing else; 64,000 rows read through a
    # memory map would have added ~250 MiB of page-sized reads to RSS
    assert r["after"] - r["before"] < r["slab"] + (32 << 20), r
