"""The qwen4exp family's decode and prompt layer programs run on the CPU against fakes (no GPU): CuPy's arrays are
NumPy's, every kernel launch is recorded and checked against its cuda_src signature (the argument count), every
mat-vec and projection against its matrix's shape. What this catches is the host side's own errors (a buffer of the
wrong size, a launch with an argument too many, an attribute that is not there) on the tiny fixture's layers (GDN,
QSA, PLE); the arithmetic is the GPU tests' (tests/test_cuda_qwen4exp*.py, test_cuda_hc.py, test_cuda_qsa.py)."""
import re
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest

pytest.importorskip("cupy")

from engine.cuda import kernels as kernel_loader  # noqa: E402
from engine.cuda import launch  # noqa: E402
from engine.cuda.families import gdn as gdn_mod  # noqa: E402
from engine.cuda.families import hybrid, moe, q4ops  # noqa: E402
from engine.cuda.families import qwen4exp as fam_mod  # noqa: E402
from engine.cuda.families.registry import family_for  # noqa: E402
from engine.cuda.weights import DevMatrix, Upload  # noqa: E402
from engine.gguf_model import open_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "qwen4exp" / "tiny-qwen4exp-iq2_xs.gguf"
_SIG = re.compile(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?"
                  r"(\w+)\s*\(([^)]*)\)", re.S)


def signatures() -> dict[str, int]:
    """Kernel name -> parameter count, from the .cu files the family launches."""
    out = {}
    for f in ("qwen4exp.cu", "hc.cu", "qsa.cu"):
        for name, params in _SIG.findall((ROOT / "cuda_src" / f).read_text()):
            out[name] = len([p for p in params.split(",") if p.strip()])
    return out


SIGS = signatures()


class Launches:
    def __init__(self):
        self.calls = []

    def fn(self, name):
        base = name.split("<")[0]

        def launch_(grid, block, args, shared_mem=0):
            assert base in SIGS, f"no kernel {base} in the sources"
            assert len(args) == SIGS[base], f"{base}: {len(args)} arguments for {SIGS[base]} parameters"
            assert all(int(g) >= 1 for g in grid) and 1 <= int(np.prod(block)) <= 1024, (base, grid, block)
            self.calls.append(base)
        return launch_

    def kern(self, name, qt=None, kind=None):
        return self.fn(name)


class FakeStream:
    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def synchronize(self):
        pass


class FakeDevice:
    attributes = {"MultiProcessorCount": 132}

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class FakeEvent:
    def __init__(self, disable_timing=False):
        self.recorded = 0

    def record(self, stream=None):
        self.recorded += 1

    def synchronize(self):
        assert self.recorded


def fake_cupy(rec):
    def empty(shape, dtype=np.float32):
        return np.full(shape, np.nan, dtype=dtype) if np.dtype(dtype).kind == "f" else np.zeros(shape, dtype)
    runtime = NS(memcpyAsync=lambda *a: rec.calls.append("memcpy"), memsetAsync=lambda *a: rec.calls.append("memset"),
                 memcpyHostToDevice=1)
    cuda = NS(runtime=runtime, get_current_stream=lambda: FakeStream(),
              Device=lambda *a: FakeDevice(), Event=FakeEvent)
    return NS(float32=np.float32, float16=np.float16, uint8=np.uint8, int32=np.int32, uint64=np.uint64,
              zeros=np.zeros, empty=empty, full=np.full, asarray=np.asarray, empty_like=np.empty_like, exp=np.exp,
              ndarray=np.ndarray, cuda=cuda)


class FakeLauncher:
    def __init__(self, rec):
        self.rec = rec

    def mv(self, W, x, y, bias=None, gate_logit=None, accumulate=False, tag="mv", norm=None):
        assert x.size == W.cols and y.size == W.rows, (tag, W.rows, W.cols, x.shape, y.shape)
        self.rec.calls.append(f"mv:{tag}")

    def mv_many(self, Ws, x, ys, norm=None, conv=None, tag="mv4", mixed=False):
        assert len(Ws) == len(ys) and all(x.size == W.cols and y.size == W.rows for W, y in zip(Ws, ys)), tag
        if conv is not None:
            state, taps, d_conv = conv
            assert state.shape == (d_conv - 1, Ws[0].rows) and taps.shape == (Ws[0].rows, d_conv), tag
        self.rec.calls.append(f"mv_many:{tag}")

    def mv_gated(self, W, x, gate, y, tag="wo"):
        assert x.size == gate.size == W.cols and y.size == W.rows
        self.rec.calls.append(f"mv_gated:{tag}")


class FakeGdnKernels:
    """engine/cuda/families/gdn.py's GdnKernels as the family calls it: every array's size checked, each call noted."""

    def __init__(self, rec, shape):
        self.rec, self.sh = rec, shape

    def delta_decode(self, act, b, a, dt_bias, ssm_a, S, z, norm_w, out, qk_norm=False):
        sh = self.sh
        assert act.size == sh.channels and b.size == a.size == dt_bias.size == ssm_a.size == sh.n_v_heads
        assert S.shape == (sh.n_v_heads, sh.head_dim, sh.head_dim) and z.size == out.size == sh.n_v_heads * sh.head_dim
        assert norm_w.size == sh.head_dim and qk_norm     # act straight from mv_many's conv epilogue
        self.rec.calls.append("gdn_delta_decode")

    def scratch(self, max_tokens):
        return NS(max_tokens=max_tokens)

    def prefill(self, qkv, z, b, a, dt_bias, ssm_a, conv_w, norm_w, conv_state, S, out, scratch, T):
        sh = self.sh
        assert T <= scratch.max_tokens and qkv.shape == (T, sh.channels) and out.shape == z.shape == (T, sh.n_v_heads * sh.head_dim)
        assert b.shape == a.shape == (T, sh.n_v_heads) and conv_state.shape == (sh.conv_kernel - 1, sh.channels)
        assert conv_w.shape == (sh.channels, sh.conv_kernel) and S.shape == (sh.n_v_heads, sh.head_dim, sh.head_dim)
        self.rec.calls.append("gdn_prefill")


class FakeKV:
    def __init__(self, cfg, max_ctx):
        p = cfg.family_params
        self.max_ctx, self.dtype = max_ctx, "f16"
        self.rows = [max_ctx] * cfg.n_layer
        self.qsa_layers = [i for i, r in enumerate(cfg.recurrent_layers) if not r]
        self.index_keys = {li: np.zeros((max_ctx, p.indexer_dim), np.float32) for li in self.qsa_layers}
        self.pooled = {li: np.zeros((fam_mod.qsa_blocks(cfg, max_ctx, li), p.indexer_dim), np.float32)
                       for li in self.qsa_layers}
        self.stored = []

    def layer(self, li):
        assert li in self.qsa_layers
        return 4096, 8192

    def store(self, kernels, cfg, li, q, k, v, q_norm, k_norm, rope, state=None, pos0=0, T=1):
        assert q.size == T * cfg.n_head * cfg.head_dim and k.size == v.size == T * cfg.n_head_kv * cfg.head_dim
        self.stored.append((li, pos0, T))


def _faked(monkeypatch, path):
    rec = Launches()
    fcp = fake_cupy(rec)
    monkeypatch.setitem(sys.modules, "cupy", fcp)
    monkeypatch.setitem(sys.modules, "cupyx", NS(empty_pinned=lambda shape, dtype: np.zeros(shape, dtype)))
    for mod in (fam_mod, moe):
        monkeypatch.setattr(mod, "cp", fcp)
    fake_ptr = lambda a: np.uint64(0) if a is None else np.uint64(64)      # noqa: E731
    for mod in (launch, q4ops, moe, hybrid, fam_mod):
        monkeypatch.setattr(mod, "ptr", fake_ptr, raising=False)
    monkeypatch.setattr(DevMatrix, "ptr", property(lambda self: 128))
    monkeypatch.setattr(moe, "DecodeAttention", lambda *a, **k: None)
    monkeypatch.setattr(kernel_loader, "load", lambda name, defines=None, qtypes=None, pairs=None: NS(
        get_function=rec.fn))
    monkeypatch.setattr(kernel_loader, "function", lambda name, kernel, defines=None: rec.fn(kernel))
    monkeypatch.setattr(gdn_mod, "GdnKernels", lambda shape: FakeGdnKernels(rec, shape))
    monkeypatch.setattr(fam_mod, "load_mixed", lambda table, pairs: rec.calls.append("load_mixed"))
    model = open_model(path)
    fam = family_for(model.config)
    w = fam.load_weights(model, Upload(model, np.asarray))
    return NS(rec=rec, model=model, fam=fam, w=w)


@pytest.fixture()
def faked(monkeypatch):
    """The tiny fixture: GDN heads of 16, which gdn.cu is not built for (qwen4exp.cu's q4_gdn_* kernels)."""
    f = _faked(monkeypatch, FIXTURE)
    yield f
    f.fam.close()


@pytest.fixture()
def faked_wide(monkeypatch, tmp_path):
    """make_moe's tiny-qwen4exp: GDN heads of 128, as the published models' (gdn.cu's sigmoid build)."""
    from tools import make_moe
    path = tmp_path / "tiny-qwen4exp-128.gguf"
    assert make_moe.main(["--preset", "tiny-qwen4exp", "--out", str(path)]) in (0, None)
    f = _faked(monkeypatch, path)
    assert f.model.config.ssm_state == 128
    yield f
    f.fam.close()


def _step(f, ctx=64):
    cfg = f.model.config
    kv = FakeKV(cfg, ctx)
    st = NS(cfg=cfg, weights=f.w, kv=kv, stream=FakeStream(), launcher=FakeLauncher(f.rec), kernel=f.rec.kern,
            kernels=f.rec.kern, keeps=lambda kind: True, x=np.zeros(cfg.n_embd, np.float32), state=np.zeros(8, np.int32),
            rope=np.zeros((ctx, cfg.n_rot // 2, 2), np.float32), logits=np.zeros(cfg.n_vocab, np.float32))
    return st, fam_mod.Q4State(cfg, FakeStream())


def test_the_decode_program_launches_what_the_sources_declare(faked, monkeypatch):
    st, state = _step(faked)
    cfg = faked.model.config
    dec = fam_mod.Q4Decode(st, state, faked.fam)
    experts = []
    monkeypatch.setattr(moe.MoeDecode, "embed", lambda self: faked.rec.calls.append("embed"))
    monkeypatch.setattr(fam_mod.Q4Decode, "experts", lambda self, li, layer, out=None: experts.append(
        (li, out.shape == (cfg.n_embd,))))
    before = state.ids.copy()
    dec.set_inputs(123, 0)
    assert list(state.ids) == [*before[1:], 123] and np.isfinite(dec.eta_host).all()
    dec.embed()
    for li in range(cfg.n_layer):
        dec.mixer(li)
        dec.ffn(li)
    dec.output()
    calls = faked.rec.calls
    assert calls[0] == "load_mixed"                                 # the two-type kernels, before any capture
    calls = calls[1:]
    assert calls[:3] == ["embed", "q4_broadcast", "memcpy"]         # the PLE rows uploaded at the step's start
    assert experts == [(li, True) for li in range(cfg.n_layer)]
    n_gdn, n_qsa = sum(cfg.recurrent_layers), cfg.n_layer - sum(cfg.recurrent_layers)
    assert calls.count("q4_gdn_delta") == n_gdn and calls.count("q4_ple_conv") == 1
    assert calls.count("mv:wo") == n_qsa and calls[-1] == "mv:output"
    assert calls.count("mv_many:qkv") == calls.count("mv_many:qsa") == n_qsa and "mv:qkv" not in calls
    assert calls.count("qsa_attn") == n_qsa and calls.count("qsa_prep") == n_qsa
    # per half-layer one write_norm (the last write fused into the next read's norm), one more before the PLE layer
    n_ple = sum(L.ple is not None for L in faked.w.layers)
    assert calls.count("hc_write_norm") == 2 * cfg.n_layer + 1 + n_ple
    assert calls.count("hc_up_mix") == 2 * cfg.n_layer + 1
    assert calls.count("mv_many:hc_down") == 2 * cfg.n_layer and calls.count("mv:hc_down") == 1    # the head: no W_inj


def test_gdn_layers_of_the_published_width_run_on_gdn_cu(faked_wide, monkeypatch):
    """Heads of 128: each GDN layer's decode is one mv_many (the conv in its epilogue) and gdn_delta_decode, its
    prompt GdnKernels.prefill over a scratch the prompt program holds; the mixed-type kernels load before capture."""
    f = faked_wide
    st, state = _step(f)
    cfg = f.model.config
    dec = fam_mod.Q4Decode(st, state, f.fam)
    monkeypatch.setattr(moe.MoeDecode, "embed", lambda self: f.rec.calls.append("embed"))
    monkeypatch.setattr(fam_mod.Q4Decode, "experts", lambda self, li, layer, out=None: None)
    assert f.rec.calls == ["load_mixed"]
    dec.set_inputs(7, 0)
    dec.embed()
    for li in range(cfg.n_layer):
        dec.mixer(li)
        dec.ffn(li)
    n_gdn = sum(cfg.recurrent_layers)
    assert f.rec.calls.count("gdn_delta_decode") == f.rec.calls.count("mv_many:gdn_in") == n_gdn
    assert "q4_gdn_delta" not in f.rec.calls and f.rec.calls.count("mv:gdn_out") == n_gdn
    names = [b.name for b in f.fam.prompt_buffers(64)]
    assert names == ["q4_prompt", "gdn_scratch"]
    narrow = family_for(open_model(FIXTURE).config)
    assert [b.name for b in narrow.prompt_buffers(64)] == ["q4_prompt"]


@pytest.mark.parametrize("T,pos0", [(8, 0), (8, 16), (5, 3)])
@pytest.mark.parametrize("which", ["faked", "faked_wide"])
def test_the_prompt_program_runs_a_chunk(request, monkeypatch, which, T, pos0):
    faked = request.getfixturevalue(which)
    st, state = _step(faked)
    cfg = faked.model.config
    N, D = cfg.n_embd, cfg.n_embd * cfg.family_params.hc_count
    rec = faked.rec

    def linear(W, X):
        assert X.ndim == 2 and X.shape[1] == W.cols, (W.rows, W.cols, X.shape)
        return np.zeros((X.shape[0], W.rows), np.float32)

    def linear_f16(W, xh, out, accumulate=False):
        assert xh.dtype == np.float16 and xh.shape[1] == W.cols and out.shape == (xh.shape[0], W.rows)
        return out

    routed = []
    table = faked.fam.rows

    def dequant(addr, qt, row_bytes, rows, cols):
        assert (qt, row_bytes, cols) == (int(table.tensor.qtype), table.row_bytes, table.width)
        rec.calls.append("dequant_rows")
        return np.zeros((rows, cols), np.float32)

    prefill = NS(cfg=cfg, kernels=rec.kern, launcher=FakeLauncher(rec), weights=faked.w, kv=st.kv, step=st,
                 dequant=dequant,
                 chunk=16, linear=linear, linear_f16=linear_f16, _mark=lambda phase: None,
                 linear_into=lambda W, X, out: out, _view=lambda name, T, width: np.zeros((T, width), np.float32),
                 route=lambda li, logits, T, renorm: routed.append((li, logits.shape, renorm)),
                 experts=lambda li, xn, x, T, gemms: routed.append((li, xn.shape, x.shape)),
                 ffn=lambda g, u, d, xn: np.zeros((xn.shape[0], d.rows), np.float32),
                 layout=NS(layer=lambda li: NS(qt_up=-1, qt_gate_up=12, qt_down=12, rb_gate_up=0)),
                 moe_mod=NS(get_function=rec.fn))
    monkeypatch.setitem(SIGS, "moe_gemm_gate_up", 0)
    monkeypatch.setitem(SIGS, "moe_gemm_down", 0)
    prog = fam_mod.Q4Prompt(prefill, state, faked.fam)
    toks = list(range(100, 100 + T))
    prog.begin_chunk(toks, pos0)
    p = cfg.family_params
    assert prog.eta.shape == (T, p.n_ple_heads * p.ple_width)
    assert rec.calls[-2:] == ["memcpy", "dequant_rows"]          # the raw rows uploaded, dequantized on the GPU
    assert list(state.ids) == toks[-2:] and table.lookups == T * p.n_ple_heads
    assert prog.host_facts()["rows_ahead"] is False
    nxt = list(range(300, 300 + T))
    prog.read_ahead(nxt)                                         # the next chunk's rows gathered on the worker
    x, xn = np.zeros((T, N), np.float32), np.zeros((T, N), np.float32)
    for li, L in enumerate(faked.w.layers):
        prog.layer(li, L, x, xn, T, pos0)
    assert prog.xs is None                          # the chunk's streams let go after the final read
    assert [r[0] for r in routed if len(r) == 3 and r[2] is True] == list(range(cfg.n_layer))
    assert all(r[1] == (T, N) and r[2] == (T, N) for r in routed if len(r) == 3 and r[2] is not True)
    r = cfg.family_params.compress_ratios[3]
    assert rec.calls.count("qsa_prep") == 1 and rec.calls.count("hc_mix_rows") == 2 * cfg.n_layer + 1
    assert rec.calls.count("qsa_pool") == (1 if (pos0 + T) // r > pos0 // r else 0)
    gdn_launch = "gdn_prefill" if which == "faked_wide" else "q4_gdn_conv"
    assert rec.calls.count(gdn_launch) == sum(cfg.recurrent_layers) and D == 4 * N
    # the next chunk: its rows are the ones gathered ahead, counted once taken
    prog.begin_chunk(nxt, pos0 + T)
    assert prog.host_facts()["rows_ahead"] is True and list(state.ids) == nxt[-2:]
    assert table.lookups == 2 * T * p.n_ple_heads
    # a chunk other than the one named ahead: gathered when asked
    prog.read_ahead(list(range(500, 500 + T)))
    prog.begin_chunk(list(range(700, 700 + T)), pos0 + 2 * T)
    assert prog.host_facts()["rows_ahead"] is False and table.lookups == 3 * T * p.n_ple_heads
