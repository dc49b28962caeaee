"""The model's non-expert weights in VRAM, each matrix in its GGUF quant format (the kernels dequantize as they read);
norm weights and biases as float32. The token embedding may instead live in mapped pinned host memory, read in place
over PCIe (engine/cuda/embed_place.py decides when)."""
from __future__ import annotations

from dataclasses import dataclass, field

import cupy as cp
import numpy as np

from engine.cuda.arena import PinnedBuffer
from engine.cuda.quant_types import qtype


@dataclass
class DevMatrix:
    data: cp.ndarray        # uint8 (rows, row_bytes); in VRAM, or a view of `host` through its device address
    qt: int                 # ggml type id
    rows: int
    cols: int
    row_bytes: int
    host: PinnedBuffer | None = None    # the mapped pinned memory behind data, when the matrix is on the host

    @property
    def ptr(self) -> int:
        return int(self.data.data.ptr)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def where(self) -> str:
        return "vram" if self.host is None else "host"

    def close(self):
        """Frees a host copy (the caller makes sure no kernel reads it any more); VRAM goes with the last reference."""
        if self.host is not None:
            self.data = None
            self.host.close()


def _shape(t):
    q = qtype(t.qtype)                      # ValueError naming the type when no kernel handles it
    rows = int(np.prod(t.shape[:-1]))
    cols = int(t.shape[-1])
    return q, rows, cols, q.row_bytes(cols)


def upload_matrix(t) -> DevMatrix:
    q, rows, cols, rb = _shape(t)
    data = cp.asarray(np.ascontiguousarray(t.data).reshape(rows, rb))
    return DevMatrix(data, q.id, rows, cols, rb)


def host_matrix(t) -> DevMatrix:
    """t's bytes, the same as upload_matrix's, in mapped pinned host memory: kernels take the same pointer argument
    and read the rows they need in place over PCIe. Pinning failures raise (CUDARuntimeError / RuntimeError)."""
    q, rows, cols, rb = _shape(t)
    buf = PinnedBuffer(rows * rb)
    try:
        buf.view[:] = np.ascontiguousarray(t.data).reshape(-1)
        mem = cp.cuda.UnownedMemory(buf.dptr, rows * rb, buf, cp.cuda.Device().id)
        data = cp.ndarray((rows, rb), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
    except BaseException:
        buf.close()
        raise
    return DevMatrix(data, q.id, rows, cols, rb, host=buf)


@dataclass
class Layer:
    attn_norm: cp.ndarray
    wq: DevMatrix
    wk: DevMatrix
    wv: DevMatrix
    wo: DevMatrix
    ffn_norm: cp.ndarray
    q_norm: cp.ndarray | None = None
    k_norm: cp.ndarray | None = None
    bq: cp.ndarray | None = None
    bk: cp.ndarray | None = None
    bv: cp.ndarray | None = None
    # dense FFN (no experts)
    w_gate: DevMatrix | None = None
    w_up: DevMatrix | None = None
    w_down: DevMatrix | None = None
    # MoE
    router: DevMatrix | None = None
    sh_gate: DevMatrix | None = None
    sh_up: DevMatrix | None = None
    sh_down: DevMatrix | None = None
    sh_gate_inp: DevMatrix | None = None
    # gpt-oss: the output projection's bias, the sink logit per q head, the router's bias, and every expert's
    # gate/up/down biases ((n_expert, n_ff), (n_expert, n_ff), (n_expert, n_embd), flat): all experts' in VRAM, so a
    # kernel reads the bias of whichever expert was routed wherever its weights are (cache slot, arena, ring)
    bo: cp.ndarray | None = None
    sinks: cp.ndarray | None = None
    router_bias: cp.ndarray | None = None
    exp_bias: tuple | None = None
    # qwen3next / qwen35moe (engine/cuda/hybrid_layers.py): a gated attention layer's gate rows of attn_q (wq holds
    # its query rows), or a Gated DeltaNet layer's weights (then wq, wk, wv, wo are None)
    attn_gate: DevMatrix | None = None
    gdn: object | None = None


@dataclass
class DeviceWeights:
    tok_embd: DevMatrix
    output: DevMatrix
    output_norm: cp.ndarray
    layers: list[Layer] = field(default_factory=list)

    def place_embedding(self, model, where: str) -> str | None:
        """Moves token_embd to "host" (mapped pinned memory) or back to "vram"; None when done, else why it stayed
        (pinning failed: it stays in VRAM). Nothing may be reading the old copy (the decode step not yet built, or
        closed and synchronized)."""
        old = self.tok_embd
        if old.where == where:
            return None
        if old is self.output:
            raise ValueError("the token embedding is tied to the output head, which reads all of it every token: it "
                             "stays in VRAM")
        t = model.tensor("token_embd.weight")
        if where == "host":
            try:
                self.tok_embd = host_matrix(t)
            except (cp.cuda.runtime.CUDARuntimeError, RuntimeError) as e:
                return f"pinning {old.nbytes / 2**20:.0f} MiB of host memory failed ({e})"
        else:
            self.tok_embd = upload_matrix(t)
        old.close()
        return None

    def close(self):
        """Frees host-resident matrices (after the last kernel that reads them)."""
        self.tok_embd.close()

    def qtype_ids(self) -> set[int]:
        ids = {self.tok_embd.qt, self.output.qt}
        for L in self.layers:
            for v in (*vars(L).values(), *(vars(L.gdn).values() if L.gdn is not None else ())):
                if isinstance(v, DevMatrix):
                    ids.add(v.qt)
        return ids


def load_weights(model) -> DeviceWeights:
    cfg = model.config

    def f32(name):
        return cp.asarray(model.dequant(name).reshape(-1).astype(np.float32))

    def opt_f32(name):
        return f32(name) if model.has(name) else None

    def mat(name):
        return upload_matrix(model.tensor(name))

    tok = mat("token_embd.weight")
    out = tok if cfg.tied_embeddings else mat("output.weight")
    dw = DeviceWeights(tok_embd=tok, output=out, output_norm=f32("output_norm.weight"))
    ffn_norm = "post_attention_norm.weight" if cfg.arch == "gpt-oss" else "ffn_norm.weight"    # llama.cpp's names
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        if cfg.is_hybrid:       # a gated attention or a Gated DeltaNet layer
            from engine.cuda.hybrid_layers import hybrid_layer
            L = hybrid_layer(model, i, f32)
        else:
            L = Layer(attn_norm=f32(b + "attn_norm.weight"), wq=mat(b + "attn_q.weight"), wk=mat(b + "attn_k.weight"),
                      wv=mat(b + "attn_v.weight"), wo=mat(b + "attn_output.weight"), ffn_norm=f32(b + ffn_norm),
                      q_norm=opt_f32(b + "attn_q_norm.weight"), k_norm=opt_f32(b + "attn_k_norm.weight"),
                      bq=opt_f32(b + "attn_q.bias"), bk=opt_f32(b + "attn_k.bias"), bv=opt_f32(b + "attn_v.bias"))
        if cfg.arch == "gpt-oss":
            L.bo, L.sinks, L.router_bias = (f32(b + n) for n in ("attn_output.bias", "attn_sinks.weight",
                                                                 "ffn_gate_inp.bias"))
            L.exp_bias = tuple(f32(b + f"ffn_{k}_exps.bias") for k in ("gate", "up", "down"))
        if cfg.is_moe:
            L.router = mat(b + "ffn_gate_inp.weight")
            if cfg.shared_expert:
                L.sh_gate, L.sh_up, L.sh_down = (mat(b + f"ffn_{k}_shexp.weight") for k in ("gate", "up", "down"))
            if cfg.shared_expert_gate:
                L.sh_gate_inp = mat(b + "ffn_gate_inp_shexp.weight")
        else:
            L.w_gate, L.w_up, L.w_down = (mat(b + f"ffn_{k}.weight") for k in ("gate", "up", "down"))
        dw.layers.append(L)
    return dw
