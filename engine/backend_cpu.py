"""The NumPy reference backend: float32 activations, weights dequantized by gguf's reference code, any machine.

It is the yardstick the CUDA backend is checked against, and the engine on a PC without a GPU.
"""
from __future__ import annotations

import ctypes
import re

import numpy as np

from engine.arch import build
from engine.arch.base import Weights
from engine.backend import MAX_WINDOW, Backend, ExpertStats, RecurrentSnapshot


class BlasThreads:
    """Set OpenBLAS's thread count at run time (what OPENBLAS_NUM_THREADS does at start).

    A one-token step is a chain of matrix-vector products bound by memory bandwidth, where a second BLAS thread
    gains little and, on a busy machine, costs a great deal: OpenBLAS's threads spin-wait for each other, and a
    SmolLM2 step was measured 8x slower with 2 threads than with 1 while other processes ran. So decode steps use
    one thread (and so do windows of up to 16 tokens); prompt chunks (real matrix products) keep the library's
    default. Where NumPy's BLAS is not an OpenBLAS we can reach (another platform or BLAS), nothing changes.
    """

    def __init__(self):
        self._set = None
        self.default = None
        try:
            maps = open("/proc/self/maps").read()
        except OSError:
            return
        for path in sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", maps))):
            lib = ctypes.CDLL(path)
            for prefix in ("scipy_openblas", "openblas"):
                for suffix in ("64_", ""):
                    setter = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                    getter = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                    if setter is not None and getter is not None:
                        self._set, self.default = setter, int(getter())
                        return

    def use(self, n: int | None) -> None:
        if self._set is not None:
            self._set(ctypes.c_int(n or self.default))


class CPUBackend(Backend):
    name = "cpu"
    judges_drafts = True        # its picks are engine/sampling.py's pick, draft distributions included

    def __init__(self, model, max_context: int, expert_cache_mb: float = 256.0, chunk: int = 256,
                 warm: bool = True, observer=None):
        super().__init__(model, max_context)
        if max_context < 1:
            raise ValueError(f"context must be at least 1 token, not {max_context}")
        self.weights = Weights(model, expert_cache_mb)
        self.net = build(model, self.weights, max_context, observer)    # observer: arch/base.Observer
        # The hybrids' caches (engine/arch/qwen3next.py, qwen4exp.py) also hold the recurrent state.
        self.kv = self.net.new_cache(max_context)
        self.recurrent = self.net.recurrent
        # A family cache with per-position states (qwen3next.HybridCache) can be cut back inside a window; another
        # recurrent one (snapshot/restore only) is rolled back by the session's snapshot and replay.
        self.rewinds_windows = not self.recurrent or getattr(self.kv, "per_position", False)
        self._window = None         # (first position, end) of the last tracked window call
        self._keep_hidden = False
        self._hidden = None
        self.chunk = chunk
        self.blas = BlasThreads()
        if warm:
            self.net.warm()

    def forward(self, tokens, all_logits: bool = False) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(tokens) == 0:
            raise ValueError("forward() needs at least one token")
        if self.n_cached + len(tokens) > self.max_context:
            raise ValueError(f"{self.n_cached} cached + {len(tokens)} new tokens exceed the context of "
                             f"{self.max_context}")
        bad = tokens[(tokens < 0) | (tokens >= self.config.n_vocab)]
        if len(bad):
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary (0..{self.config.n_vocab - 1})")
        outs, hidden = [], []
        self.blas.use(1 if len(tokens) <= 16 else None)
        window = self.recurrent and self.rewinds_windows and all_logits and 1 < len(tokens) <= MAX_WINDOW
        self._window = (self.n_cached, self.n_cached + len(tokens)) if window else None
        if self.recurrent and self.rewinds_windows:
            self.kv.track(window)
        if all_logits and 1 < len(tokens) <= MAX_WINDOW:
            return self._window_forward(tokens)
        # Chunks bound the attention scores' memory (heads x chunk x context) for long prompts.
        for s in range(0, len(tokens), self.chunk):
            part = tokens[s:s + self.chunk]
            last = s + self.chunk >= len(tokens)
            logits = self.net.forward(part, self.n_cached, self.kv, all_logits)
            self.n_cached += len(part)
            if self._keep_hidden:
                if self.net.last_hidden is None:
                    raise RuntimeError(f"the {self.config.arch} forward keeps no hidden rows")
                hidden.append(self.net.last_hidden)
            if all_logits or last:
                outs.append(logits)
        self._hidden = np.concatenate(hidden, axis=0) if self._keep_hidden else None
        return np.concatenate(outs, axis=0) if all_logits else outs[-1]

    def _window_forward(self, tokens: np.ndarray) -> np.ndarray:
        """A verify window: its tokens one at a time, each through the one-token forward, so that every position's
        logits, K/V and recurrent state are plain decoding's bit for bit. A T-row forward is not: NumPy multiplies
        one row by a matrix with BLAS's gemv and T rows with its gemm, whose sums round differently (and so do the
        attention's scores over the window's masked columns); on tiny-qwen35moe a 4-token window so parted from
        plain greedy at a near-tie, 14 tokens in. The hybrids' per-position states (HybridCache.track) gather
        across the calls; an observer hears window(T) first, so that a bench still sees the window as one."""
        outs, hidden = [], []
        self.net.observer.window(len(tokens))
        for i in range(len(tokens)):
            outs.append(self.net.forward(tokens[i:i + 1], self.n_cached, self.kv, False)[None])   # forward()'s step
            self.n_cached += 1
            if self._keep_hidden:
                if self.net.last_hidden is None:
                    raise RuntimeError(f"the {self.config.arch} forward keeps no hidden rows")
                hidden.append(self.net.last_hidden)
        self._hidden = np.concatenate(hidden, axis=0) if self._keep_hidden else None
        return np.concatenate(outs, axis=0)

    def window_cost(self, n_tokens: int) -> float:
        # A window runs its tokens as one-token steps (_window_forward says why): n steps, plus the picks' and the
        # drafts' bookkeeping.
        return float(n_tokens)

    def keep_hidden(self, on: bool) -> bool:
        self._keep_hidden = bool(on)
        return True

    def hidden(self) -> np.ndarray:
        if self._hidden is None:
            raise RuntimeError("no hidden rows kept: call keep_hidden(True) before the forward")
        return self._hidden

    def truncate(self, n: int) -> None:
        window = self._window
        inside = window is not None and window[0] <= n <= self.n_cached == window[1]
        if self.recurrent and n not in (0, self.n_cached) and not inside:
            raise ValueError(f"cannot truncate to {n} of {self.n_cached}: a recurrent state cannot be rewound; "
                             f"restore_state() a snapshot taken at or before {n}, or truncate(0)")
        super().truncate(n)
        if self.recurrent and n == 0:
            self.kv.reset_state()
        elif self.recurrent and inside and n < window[1]:
            self.kv.rewind(n - window[0])
        self._window = None

    def state_bytes(self) -> int:
        return self.kv.state_bytes() if self.recurrent else 0

    def snapshot_state(self) -> RecurrentSnapshot:
        if not self.recurrent:
            return super().snapshot_state()
        return RecurrentSnapshot(self.n_cached, self.kv.state_bytes(), self.kv.copy_state())

    def restore_state(self, snap: RecurrentSnapshot) -> None:
        super().restore_state(snap)
        self._window = None
        if self.recurrent:
            self.kv.load_state(snap.data)

    def prompt_chunk_size(self) -> int:
        return self.chunk

    def reset_stats(self) -> None:
        self.weights.stats = ExpertStats()
        self.net.reset_stats()

    def request_info(self) -> dict:
        return self.net.request_info()

    def get_stats(self) -> ExpertStats:
        return self.weights.stats

    def info(self) -> dict:
        # The worker's own INFO line already names the backend, arch and shapes: only what the backend adds.
        facts = self.net.info()
        if self.config.is_moe:
            facts = {"expert_cache_mib": round(self.weights.expert_cache_bytes / 2**20), **facts}
        return facts

    def close(self) -> None:
        self.weights = None
        self.net = None
        self.kv = None
