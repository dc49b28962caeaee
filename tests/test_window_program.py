"""The window step's launch program (engine/cuda/decode_window.py) on the CPU, its kernels faked: for every window
length and each tiny file's layers, every launch passes as many arguments as its kernel in cuda_src/ takes, within
the shared memory a block may have, and in the order the one-token step's layers launch (attention of token t
after its Q/K/V and on state row t, the router once per token, the expert union before the expert kernels); and
decode_window.why_not keeps windows off where the window program does not apply."""
import re
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest

pytest.importorskip("cupy")

from engine.cuda import decode_window as dw  # noqa: E402
from engine.cuda.kernels import CUDA_SRC, _KERNEL  # noqa: E402
from engine.cuda.launch import SMEM_MAX, Launcher  # noqa: E402

MODELS = ("tiny-llama-legacy", "tiny-qwen3moe-q4k", "tiny-qwen2moe-mixed")


def kernel_arity() -> dict[str, int]:
    """Each kernel's parameter count, from its signature in cuda_src/*.cu."""
    out = {}
    for p in CUDA_SRC.glob("*.cu"):
        text = p.read_text()
        for m in re.finditer(_KERNEL, text):
            i, depth = m.end(), 1
            j = i
            while depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            params = text[i:j - 1].strip()
            out.setdefault(m.group(1), 0 if not params else params.count(",") + 1)
    return out


ARITY = kernel_arity()


class Dev(np.ndarray):
    """A host array standing in for a device one: .data.ptr is its address."""

    @property
    def data(self):
        return NS(ptr=self.ctypes.data)


def dev_zeros(shape, dtype=np.float32):
    return np.zeros(shape, dtype).view(Dev)


class Mapped:
    def __init__(self, n):
        self.view = np.zeros(n, np.int32)
        self.dptr = np.uint64(self.view.ctypes.data)

    def close(self):
        pass


class Table:
    """A kernel table recording launches: (name, qt, grid, block, args, shared_mem)."""

    def __init__(self, log):
        self.log = log
        self.qtype_ids = []

    def __call__(self, name, qt=None, tag=None):
        if name not in ARITY:
            raise KeyError(name)

        def launch(grid, block, args, shared_mem=0):
            assert len(args) == ARITY[name], (name, len(args), ARITY[name])
            assert shared_mem <= SMEM_MAX, (name, shared_mem)
            self.log.append(NS(name=name, qt=qt, grid=grid, block=block, args=args, smem=shared_mem))
        return _Fn(launch)


class _Fn:
    def __init__(self, launch):
        self._launch = launch
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, *a, **kw):
        self._launch(*a, **kw)


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def window_step(fixtures_dir, name, monkeypatch, path=None):
    from engine.cuda.arena import blob_layout
    from engine.cuda.families.gptoss import GptOssFamily
    from engine.cuda.families.moe import MoeFamily
    from engine.cuda.weights import Upload
    from engine.gguf_model import open_model
    monkeypatch.setattr(dw, "cp", NS(zeros=dev_zeros, float32=np.float32, int32=np.int32))
    monkeypatch.setattr(dw, "MappedInts", Mapped)
    model = open_model(path or fixtures_dir / "reference" / f"{name}.gguf")
    cfg = model.config
    log = []
    oss = cfg.arch == "gpt-oss"
    fam = (GptOssFamily if oss else MoeFamily)(cfg)
    weights = fam.load_weights(model, Upload(model, lambda a: np.asarray(a).view(Dev)))
    attn_calls = []

    def attn_step(kernels, li, q, k, v, qn, kn, rope, out, state, scale):
        assert q.shape == (cfg.n_head * cfg.head_dim,) and k.shape == v.shape == (cfg.n_head_kv * cfg.head_dim,)
        assert out.shape == q.shape and state.shape == (dw.ROW_STATE,)
        log.append(NS(name="attention", li=li, q=q.ctypes.data, state=state.ctypes.data, args=()))
        attn_calls.append((li, state.ctypes.data))
    class WindowAttention:
        """kv.DecodeAttention of a window's queries, faked: its store / attend calls logged."""

        def __init__(self, kernels, cfg_, kv, n_split, fused, variant, n_q_max, split):
            assert n_split == 3 and split and not fused and n_q_max * G <= 64
            self.n_q_max = n_q_max

        def store(self, kernels, li, q, k, v, qn, kn, rope, state, pos0=0, T=1):
            assert q.shape[1] == cfg.n_head * cfg.head_dim and k.shape[1] == v.shape[1] == cfg.n_head_kv * cfg.head_dim
            log.append(NS(name="attn_store", li=li, T=T, pos0=pos0, q=q.ctypes.data, state=state.ctypes.data, args=()))

        def attend(self, kernels, li, q, out, state, scale, n_fixed=0, n_q=1, pos0=0):
            log.append(NS(name="attn_window", li=li, n_q=n_q, pos0=pos0, q=q.ctypes.data, out=out.ctypes.data,
                          state=state.ctypes.data, args=()))
    monkeypatch.setattr(dw, "DecodeAttention", WindowAttention)
    G = cfg.n_head // cfg.n_head_kv
    n = cfg.n_layer * max(cfg.n_expert, 1)
    cache = NS(table=dev_zeros(n, np.uint64), slot_lo=0, slot_hi=0, counts=dev_zeros(n, np.int32),
               stats=dev_zeros(2, np.uint64)) if cfg.is_moe else None
    attn = NS(step=attn_step, split=True, variant=NS(fused_only=oss), group=G, n_split=3)
    ctx = 64
    kv = NS(max_ctx=ctx, rows=[ctx // 2 if oss and li % 2 == 0 else ctx for li in range(cfg.n_layer)])
    step = NS(cfg=cfg, kernels=Table(log), stream=_Stream(), weights=weights, cache=cache, kv=kv,
              layout=blob_layout(model) if cfg.is_moe else None, rope=dev_zeros(8), counter=dev_zeros(1, np.int32),
              layers=NS(attn=attn), launcher=Launcher(None, cfg))
    return fam.window_program()[1](step, kernels=Table(log)), log


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", ["tokens", "union", "shared"])
def test_every_launch_matches_its_kernel(fixtures_dir, name, mode, monkeypatch):
    win, log = window_step(fixtures_dir, name, monkeypatch)
    win.dense_mode, win.expert_mode = {"tokens": ("tokens", "tokens"), "union": ("tokens", "union"),
                                       "shared": ("shared", "serial")}[mode]
    win.attn_mode = "tokens"        # the one-token attention a token (the window's own: the test below)
    cfg = win.cfg
    assert win.max_t == 8
    sfx = "_win" if mode == "shared" else "_tok"
    for T in range(1, 9):
        log.clear()
        win.enqueue(T)
        names = [e.name for e in log]
        assert names[:2] == ["win_setup", "embed"] and log[1].grid == (T,)
        assert names[-2 * T:] == ["argmax_word", "argmax_finish"] * T
        assert names.count("attention") == T * cfg.n_layer
        # token t's attention reads state row t, after the layer's Q/K/V launch
        rows = [e.state for e in log if e.name == "attention"]
        assert rows == [int(win.state[t].ctypes.data) for t in range(T)] * cfg.n_layer
        other = "_tok" if mode == "shared" else "_win"
        assert not any(nm.endswith(other) and nm not in ("router_win", "moe_gate_up_win") for nm in names)
        if cfg.is_moe:
            gu, dn = {"tokens": ("moe_gate_up", "moe_down"), "union": ("moe_gate_up_win", "moe_down"),
                      "shared": ("moe_gate_up_win", "moe_down_win")}[mode]
            assert names.count("router_win") == names.count(gu) == names.count(dn) == cfg.n_layer
            for i, nm in enumerate(names):
                if nm == gu:            # the router's routing (and union), then the window's experts
                    assert names[i - 1] == "router_win"
                    r = log[i - 1]
                    if mode == "tokens":
                        assert log[i].grid[1:] == (cfg.n_expert_used, T) and r.args[-3] == 0
                    else:
                        assert log[i].grid[1] == min(T * cfg.n_expert_used, cfg.n_expert)
                        assert r.args[-3] == log[i].args[1]
                    assert r.args[-2] == T and r.args[-1] == 0      # no router bias here
                if nm == dn and mode != "shared":
                    assert log[i].grid[1] == T
            if mode == "tokens":
                assert "moe_gate_up_win" not in names
            if cfg.shared_expert:
                assert names.count("swiglu" + sfx) == cfg.n_layer
        else:
            assert names.count("swiglu" + sfx) == cfg.n_layer
        for e in log:
            if e.name in ("mv_win", "mv3_win", "swiglu_win"):
                assert e.args[-1] == T, e.name          # one launch takes the whole window at these widths
            if e.name in ("mv_tok", "mv3_tok", "swiglu_tok"):
                assert e.grid[0] == T and e.grid[1] < 65536, e.name     # the tokens' blocks side by side
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        win.enqueue(9)


@pytest.mark.parametrize("name", MODELS)
def test_window_attention_takes_the_window_at_once(fixtures_dir, name, monkeypatch):
    """attn_mode "window" (the default): per layer one K/V store of the T tokens at state row 0's position, then the
    T queries in one attend (launches of at most n_q_max when the group is wide), after Q/K/V and before wo."""
    win, log = window_step(fixtures_dir, name, monkeypatch)
    assert win.attn_mode == "window" and win.wattn is not None
    cfg = win.cfg
    row0 = int(win.state.ctypes.data)
    for T in range(1, 9):
        log.clear()
        win.enqueue(T)
        names = [e.name for e in log]
        assert "attention" not in names
        stores = [e for e in log if e.name == "attn_store"]
        assert [e.li for e in stores] == list(range(cfg.n_layer))
        assert all(e.T == T and e.pos0 == 0 and e.state == row0 and e.q == win.q.ctypes.data for e in stores)
        for i, nm in enumerate(names):
            if nm == "attn_store":
                assert names[i - 1] in ("mv3_tok", "mv_tok") and names[i + 1] == "attn_window"
        att = [e for e in log if e.name == "attn_window"]
        n = win.wattn.n_q_max
        assert len(att) == cfg.n_layer * -(-T // n)
        for e in att:
            assert e.state == row0 and e.n_q == min(n, T - e.pos0)
            assert e.q == win.q[e.pos0].ctypes.data and e.out == win.att[e.pos0].ctypes.data


def test_launches_split_the_tokens_where_their_staging_does_not_fit(fixtures_dir, monkeypatch):
    """A 16384-wide input staged for 8 tokens would need 557 KiB: the window's tokens go in launches of as many as
    stage_budget holds (1 at half the shared memory, 3 at all of it)."""
    win, log = window_step(fixtures_dir, "tiny-llama-legacy", monkeypatch)
    win.dense_mode = "shared"
    W = NS(qt=12, rows=64, cols=16384, row_bytes=16384 // 256 * 144, ptr=0)
    x, y = dev_zeros((8, 16384)), dev_zeros((8, 64))
    norm = dev_zeros(16384)
    win.mv(W, x, y, 8, norm=norm)
    assert [e.args[-1] for e in log] == [1] * 8
    log.clear()
    win.stage_budget = SMEM_MAX
    win.mv(W, x, y, 8, norm=norm)
    assert [e.args[-1] for e in log] == [3, 3, 2]
    assert [e.args[2] for e in log] == [x[t].ctypes.data for t in (0, 3, 6)]
    log.clear()
    win.mv(W, x, y, 8)         # unnormed and wider than 48 KiB staged: read from global memory, one launch
    assert [e.args[-1] for e in log] == [8] and log[0].smem == 0


def test_down_smem_and_window_tokens():
    assert dw.down_smem(8, 8, 768, True) == 4 * 8 * 8 * 24 * 4
    assert dw.down_smem(8, 8, 768, False) == 4 * 8 * 8 * 32 * 4
    assert dw.window_tokens(NS(n_embd=2048)) == 8
    assert dw.window_tokens(NS(n_embd=7168)) == 7


def _backend(**kw):
    from engine.cuda.families.moe import MoeDecode, MoeFamily
    cfg = NS(is_moe=True, n_layer=2, n_expert_used=8, n_expert=16)
    fam = MoeFamily(cfg)
    be = NS(opts=NS(windows=True), family=fam, step=NS(layers=MoeDecode.__new__(MoeDecode)), recurrent=False,
            mem=None, config=cfg, layout=NS(layer=lambda li: NS(qt_up=-1)), kv=NS(max_ctx=64, rows=[64, 64]))
    for k, v in kw.items():
        setattr(be, k, v)
    return be


def test_why_not():
    assert dw.why_not(_backend()) is None
    assert "windows=off" in dw.why_not(_backend(opts=NS(windows=False)))
    assert "recurrent" in dw.why_not(_backend(recurrent=True))
    assert "memory modes" in dw.why_not(_backend(mem=object()))
    assert "gate and up" in dw.why_not(_backend(layout=NS(layer=lambda li: NS(qt_up=14))))
    from engine.cuda.families.gptoss import GptOssDecode, GptOssFamily
    from engine.cuda.families.hybrid import HybridFamily
    assert "family" in dw.why_not(_backend(family=HybridFamily.__new__(HybridFamily)))
    oss = GptOssFamily.__new__(GptOssFamily)
    assert "family" in dw.why_not(_backend(family=oss))      # its family with another family's layers
    assert dw.why_not(_backend(family=oss, step=NS(layers=GptOssDecode.__new__(GptOssDecode)))) is None


def test_gptoss_program(fixtures_dir, monkeypatch, tmp_path):
    """gpt-oss's window program on the tiny preset (MXFP4 experts): its own expert kernels with the biases, the
    router's bias and the output projection's."""
    from tools import make_moe
    from tools.gptoss_ref import PRESET
    path = tmp_path / "oss.gguf"
    assert make_moe.main([*PRESET, "--norm", "F32", "--out", str(path)]) == 0
    win, log = window_step(fixtures_dir, None, monkeypatch, path)
    cfg = win.cfg
    for T, mode in [(T, m) for T in range(1, 9) for m in ("tokens", "union", "serial")]:
        win.expert_mode = mode
        log.clear()
        win.enqueue(T)
        names = [e.name for e in log]
        gu, dn = {"tokens": ("moe_gate_up_oai", "moe_down_bias"), "union": ("moe_gate_up_oai_win", "moe_down_bias"),
                  "serial": ("moe_gate_up_oai_win", "moe_down_bias_win")}[mode]
        assert names.count(gu) == names.count(dn) == cfg.n_layer
        assert "moe_gate_up_win" not in names and "moe_down_win" not in names and "moe_gate_up" not in names
        wo = [e for e in log if e.name in ("mv_win", "mv_tok") and e.args[9] == cfg.n_head * cfg.head_dim
              and e.args[8] == cfg.n_embd]
        assert len(wo) == cfg.n_layer and all(e.args[6] != 0 for e in wo)     # wo with attn_output.bias
        assert all(e.args[-1] != 0 for e in log if e.name == "router_win")    # the router's bias


def test_window_cost_from_the_measured_table():
    """The speculation rule's cost of a window (CUDABackend.window_cost): a step a token with no table; else the
    table's lengths, linear between them, windows past max_t as several launches."""
    assert dw.window_cost(5, 8, {}) == 5.0
    table = {2: 1.2, 4: 1.5, 8: 2.5}
    assert dw.window_cost(1, 8, table) == 1.0
    assert dw.window_cost(4, 8, table) == 1.5
    assert dw.window_cost(3, 8, table) == pytest.approx(1.35)
    assert dw.window_cost(6, 8, table) == pytest.approx(2.0)
    assert dw.window_cost(10, 8, table) == pytest.approx(2.5 + 1.2)
    assert dw.window_cost(9, 7, table) == pytest.approx(2.25 + 1.2)
