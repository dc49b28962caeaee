"""Routing near-ties, for the tests that compare a CUDA prompt pass with the NumPy backend.

Where a token's k-th and (k+1)-th router logits are closer than fp16 activations resolve, the CUDA pass may send the
token to the other expert. Its logits then differ by 10-60% (the tiny fixtures' experts are random and unrelated), and
later tokens by up to ~1% through its K/V: on tiny-qwen2moe-mixed, token 192's layer-0 gap of 1.3e-4 did exactly this
on the H200 (0.225 on that row). That is a near-tie parting, not an engine error; a route taken against a clear gap
is one. So the CUDA side records the routes it took (RouteRecorder, the backend's tracer), and `reference` runs the
NumPy backend taking those routes where, and only where, its own gap is under ROUTE_TIE, and reports every place the two parted.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import numpy as np

from engine.arch import base
from engine.backend_cpu import CPUBackend
from engine.cuda.trace import ChunkFacts

# Router-logit gap (k-th minus (k+1)-th) under which the CUDA pass may part the routes: twice the most that a NumPy
# model of the streamed pass's roundings moved a gap (fp16 q/k/v/o and expert GEMM operands, fp16 K/V, fp16 q and P in
# the flash attention; 215 tokens x 4 layers, routes held equal): 2.7e-2 on tiny-qwen2moe-mixed, 5.0e-2 on
# tiny-qwen3moe-q4k (medians 2.7e-3, 1.7e-3). With int8 K/V: 0.23 and 0.33 (medians 2.1e-2, 9.7e-3).
ROUTE_TIE = 0.1
ROUTE_TIE_KV8 = 0.66


class RouteRecorder(ChunkFacts):
    """The CUDA backend's tracer for these tests: while `routes` is a list, the prompt pass's routes go there as
    (pos0, layer, ids (T, k) device copy) records, per chunk and MoE layer; `last`: the last chunk's facts."""

    def __init__(self, **timing):
        super().__init__(**timing)
        self.routes = None

    def prefill_routes(self, pos0, layer, ids):
        if self.routes is not None:
            self.routes.append((pos0, layer, ids.copy()))


def gpu_routes(records, cupy_get=lambda a: a.get()) -> dict[tuple[int, int], frozenset]:
    """{(position, layer): the expert set} from RouteRecorder.routes' (pos0, layer, ids (T, k)) records."""
    out = {}
    for pos0, li, ids in records:
        for t, row in enumerate(np.asarray(cupy_get(ids)).reshape(len(ids), -1)):
            out[(pos0 + t, li)] = frozenset(int(e) for e in row)
    return out


def gap(logits: np.ndarray, k: int) -> np.ndarray:
    """Per row, the k-th largest logit minus the (k+1)-th."""
    s = np.sort(logits, axis=-1)
    return s[:, -k] - s[:, -k - 1]


@contextmanager
def _routing(net, taken: dict, parted: list, margins: dict, ranked: dict, tie: float):
    """net's MoE layers route as the NumPy backend does, except that a row whose gap is under `tie` takes the
    experts in `taken` ((position, layer) -> set). Every (position, layer, gap, ours, theirs) where `taken` differs
    goes to `parted`; every gap to `margins`, every row's k + 1 best experts to `ranked`."""
    mod = sys.modules[type(net).__module__]
    # gpt-oss routes by route_softmax_weight (the softmax over the chosen logits), the others by base.route
    softmax_weight = getattr(mod, "route_softmax_weight", None)
    if getattr(mod, "route", None) is None and softmax_weight is None:      # a dense model routes nothing
        yield
        return
    orig_route, orig_ffn, orig_forward = getattr(mod, "route", None), net.ffn, net.forward
    where = {"layer": 0, "pos0": 0}

    def forward(tokens, pos0, kv, all_logits):
        where["pos0"] = pos0
        return orig_forward(tokens, pos0, kv, all_logits)

    def ffn(il, x, decoding):
        where["layer"] = il
        return orig_ffn(il, x, decoding)

    def route(logits, k, renormalize, scale=1.0):
        if softmax_weight is not None:
            ids, weights = softmax_weight(logits, k)
        else:
            ids, weights = base.route(logits, k, renormalize, scale)
        g = gap(logits, k)
        probs = base.softmax(logits.astype(np.float32))
        for t in range(len(ids)):
            key = (where["pos0"] + t, where["layer"])
            margins[key] = float(g[t])
            ranked[key] = np.argsort(-logits[t], kind="stable")[:k + 1].tolist()
            want = taken.get(key)
            if want is None or want == frozenset(ids[t].tolist()):
                continue
            parted.append((*key, float(g[t]), sorted(ids[t].tolist()), sorted(want)))
            if g[t] < tie:
                # theirs, weighted as route() weights any choice: softmax probabilities, renormalized, scaled
                # (gpt-oss: the softmax over the chosen, which is the renormalized one)
                ids[t] = sorted(want, key=lambda e: -probs[t, e])
                w = probs[t, ids[t]]
                weights[t] = (w / w.sum() if renormalize or softmax_weight else w) * np.float32(scale)
        return ids, weights

    net.ffn, net.forward = ffn, forward
    if softmax_weight is not None:
        mod.route_softmax_weight = lambda logits, k: route(logits, k, True)
    else:
        mod.route = route
    try:
        yield
    finally:
        if softmax_weight is not None:
            mod.route_softmax_weight = softmax_weight
        else:
            mod.route = orig_route
        del net.ffn, net.forward      # the instance attributes go; the class's methods show through again


class Reference:
    """The NumPy backend following `taken` at its near-ties (gaps under `tie`): `forward` as CPUBackend.forward;
    `parted` lists (position, layer, gap, ours, theirs) wherever taken differed (followed only at a near-tie);
    `margins` has every (position, layer) gap, `ranked` its k + 1 best experts, best first."""

    def __init__(self, model, ctx: int, taken: dict | None = None, tie: float = ROUTE_TIE):
        self.cpu = CPUBackend(model, ctx)
        self.tie = tie
        self.taken = dict(taken or {})
        self.parted: list[tuple] = []
        self.margins: dict[tuple[int, int], float] = {}
        self.ranked: dict[tuple[int, int], list[int]] = {}

    def forward(self, tokens, all_logits: bool = False) -> np.ndarray:
        with _routing(self.cpu.net, self.taken, self.parted, self.margins, self.ranked, self.tie):
            return self.cpu.forward(tokens, all_logits=all_logits)

    def clear_parts(self) -> list[tuple]:
        """The places taken differed against a clear gap (>= tie): each is a routing error."""
        return [p for p in self.parted if p[2] >= self.tie]

    def close(self) -> None:
        self.cpu.close()


def greedy_reference(ref: Reference, prompt, n: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and each step's logits (n, vocab) from the reference (the prompt's routes as taken)."""
    logits = [ref.forward(prompt)]
    toks = []
    while True:
        toks.append(int(np.argmax(logits[-1])))
        if len(toks) == n:
            return toks, np.stack(logits)
        logits.append(ref.forward([toks[-1]]))
