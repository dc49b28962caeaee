"""The MTP (nextn) block of qwen3next / qwen35moe files as a drafter, on NumPy, as llama.cpp 0c1e570 runs it
(src/models/qwen35moe.cpp and qwen3next.cpp, graph_mtp; common/speculative.cpp, draft-mtp).

The block is blk.{n_layer}, after the trunk: a gated-attention layer with the trunk's FFN (routed experts plus the
gated shared expert) and four nextn tensors. At position p it reads the token x_p and h_{p-1}, the trunk's last
hidden row after the output norm at p - 1 (what predicted x_p), and predicts x_{p+1}:
    u = eh_proj [rms_norm(embd(x_p), enorm) | rms_norm(h_{p-1}, hnorm)]
    u = u + gated_attention(rms_norm(u, attn_norm))          (its own KV cache, RoPE at p)
    u = u + moe(rms_norm(u, post_attention_norm))
    h = rms_norm(u, shared_head_norm, else output_norm);  logits = h @ (shared_head_head, else output)
embd is nextn.embed_tokens where the file has it, else token_embd. A draft chains: the block's own h and its draft
feed the next position. Its KV cache follows the trunk's positions: every token the trunk reads is read here too,
paired with the trunk's hidden row one position back (observe), so the pairs in the cache are the trunk's and only
the draft positions use the block's own rows, which observe then replaces by the trunk's. The first position has no
row before it: zeros, as llama.cpp's. After the session cuts back, the row before the cut comes from the last
RECENT rows kept, else zeros (a draft is then a little worse, never wrong).

Drafts are the block's argmax, so a sampled request draws the very tokens it draws without drafts. With `sampled`
(the worker's --draft-sampled, on a backend that judges draft distributions: Backend.judges_drafts), a request that
samples gets drafts drawn from the block's distribution under its sampling chain, with that distribution beside
each: more of them are accepted where the block is good, and engine/sampling.py's rule keeps the output
distributed as the target's, though a seed then draws other tokens than without drafts.
"""
from __future__ import annotations

import numpy as np

from engine.arch import build
from engine.arch.base import Weights, rms_norm
from engine.drafters.base import Draft, Drafter

RECENT = 64         # trunk hidden rows kept for the cuts back a session makes (turns end a few tokens back)
NEXTN = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight")


def mtp_unsupported(backend, model) -> str | None:
    """Why this model and backend have no MTP drafter here, or None."""
    from engine.arch.qwen3next import Qwen3Next
    from engine.arch import family
    cfg = model.config
    f = family(cfg.arch, cfg.is_moe)
    if f is None or not issubclass(f.MODEL, Qwen3Next):
        return f"{cfg.arch} has no MTP block this engine runs (qwen3next and qwen35moe files carry one)"
    if getattr(cfg, "n_layer_nextn", 0) < 1:
        return f"{model.path.name} has no MTP block ({cfg.arch}.nextn_predict_layers is 0)"
    missing = [n for n in NEXTN if not model.has(f"blk.{cfg.n_layer}.{n}")]
    if missing:
        return f"{model.path.name}'s MTP block lacks {', '.join(missing)}"
    if not backend.keep_hidden(True):
        return f"the {backend.name} backend gives no hidden rows yet (the MTP block reads them): the cpu backend does"
    return None


class BlockCache:
    """The block's K/V: the one attention layer's, indexed like the trunk's (k[il], v[il])."""

    def __init__(self, il: int, n_head_kv: int, head_dim: int, max_context: int, dtype=np.float32):
        self.il, self.max_context, self.dtype = il, max_context, dtype
        self.shape = (n_head_kv, head_dim)
        self.capacity = 0
        self.k: dict[int, np.ndarray] = {}
        self.v: dict[int, np.ndarray] = {}
        self.ensure(1)

    def ensure(self, n: int) -> None:
        if n > self.max_context:
            raise ValueError(f"{n} positions exceed the context of {self.max_context}")
        if n <= self.capacity:
            return
        cap = min(self.max_context, max(n, 2 * self.capacity, 256))
        for d in (self.k, self.v):
            new = np.zeros((self.shape[0], cap, self.shape[1]), self.dtype)
            if self.capacity:
                new[:, :self.capacity] = d[self.il]
            d[self.il] = new
        self.capacity = cap


class MTPDrafter(Drafter):
    name = "mtp"
    needs_hidden = True

    def __init__(self, model, weights: Weights, max_context: int, sampled: bool = False):
        cfg = model.config
        self.model, self.w, self.cfg = model, weights, cfg
        self.il = cfg.n_layer
        self.net = build(model, weights, max_context)       # the family's layer code (gated attention, MoE)
        self.kv = BlockCache(self.il, cfg.n_head_kv, cfg.head_dim, max_context)
        self.sampled = sampled
        b = f"blk.{self.il}.nextn."
        self.embd = b + "embed_tokens.weight" if model.has(b + "embed_tokens.weight") else "token_embd.weight"
        self.head_norm = b + "shared_head_norm.weight" if model.has(b + "shared_head_norm.weight") \
            else "output_norm.weight"
        self.head = b + "shared_head_head.weight" if model.has(b + "shared_head_head.weight") else self.net.output_name
        self.n = 0                                  # positions held (the trunk's)
        self.pending = np.zeros(cfg.n_embd, np.float32)     # the trunk's row at n - 1
        self.recent: dict[int, np.ndarray] = {}     # position -> the trunk's row there, the last RECENT
        self.primed = None                          # (position, token) whose entry a draft already wrote

    @classmethod
    def for_backend(cls, backend, model, sampled: bool = False) -> MTPDrafter:
        """Beside a backend (mtp_unsupported said yes): the CPU backend's dequantized weights are shared."""
        weights = getattr(backend, "weights", None)
        if not isinstance(weights, Weights):
            weights = Weights(model)
        return cls(model, weights, backend.max_context, sampled=sampled and backend.judges_drafts)

    # --- the block ---------------------------------------------------------------------------------------------
    def block(self, tokens, rows: np.ndarray, pos0: int) -> np.ndarray:
        """Run the block at positions pos0.. on (token, previous row) pairs: its output rows after the head norm."""
        cfg, w, b, eps = self.cfg, self.w, f"blk.{self.il}.", self.cfg.rms_eps
        self.kv.ensure(pos0 + len(tokens))
        e = w.rows(self.embd, np.asarray(tokens, np.int64))
        u = np.concatenate([rms_norm(e, w.get(b + "nextn.enorm.weight"), eps),
                            rms_norm(np.asarray(rows, np.float32), w.get(b + "nextn.hnorm.weight"), eps)], axis=1)
        u = u @ w.get(b + "nextn.eh_proj.weight").T
        u = u + self.net.gated_attention(self.il, rms_norm(u, w.get(b + "attn_norm.weight"), eps), pos0, self.kv)
        u = u + self.net.ffn(self.il, rms_norm(u, w.get(b + "post_attention_norm.weight"), eps), False)
        return rms_norm(u, w.get(self.head_norm), eps)

    def logits(self, h: np.ndarray) -> np.ndarray:
        return h @ self.w.get(self.head).T

    # --- the drafter -------------------------------------------------------------------------------------------
    def rewind(self, n: int) -> None:
        if n >= self.n:
            return
        self.n = n
        self.pending = self.recent.get(n - 1, np.zeros(self.cfg.n_embd, np.float32))
        self.recent = {p: r for p, r in self.recent.items() if p < n}
        self.primed = None

    def observe(self, tokens, hidden) -> None:
        tokens = [int(t) for t in tokens]
        hidden = np.asarray(hidden, np.float32)
        if len(hidden) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens with {len(hidden)} hidden rows")
        rows = np.concatenate([self.pending[None], hidden[:-1]], axis=0)
        start = 1 if self.primed == (self.n, tokens[0]) else 0      # propose() wrote that entry from the same pair
        if start < len(tokens):
            self.block(tokens[start:], rows[start:], self.n + start)
        for i in range(max(0, len(tokens) - RECENT), len(tokens)):
            self.recent[self.n + i] = hidden[i]
        self.n += len(tokens)
        self.recent = {p: r for p, r in self.recent.items() if p >= self.n - RECENT}
        self.pending = hidden[-1]
        self.primed = None

    def propose(self, last: int, k: int, sampler=None) -> Draft:
        if k <= 0:
            return Draft([])
        params = sampler.params if sampler is not None else None
        sampled = params is not None and not params.greedy and self.sampled
        rng = np.random.default_rng([sampler.seed, sampler.draws, 0x5EC]) if sampled else None
        tokens, probs = [], []
        tok, row = int(last), self.pending
        for i in range(k):
            h = self.block([tok], row[None], self.n + i)
            lg = self.logits(h)[0]
            if sampled:
                q = params.probabilities(lg)
                tok = int(min(np.searchsorted(np.cumsum(q), rng.random() * q.sum(), side="right"), len(q) - 1))
                probs.append(q)
            else:
                tok = int(np.argmax(lg))
            tokens.append(tok)
            row = h[0]
        self.primed = (self.n, int(last))
        return Draft(tokens, probs if sampled else None)
