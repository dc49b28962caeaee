"""The host's own time per decode token, the device a no-op: CUDABackend.decode's Python (the pipeline's bookkeeping
included) and the session's loop over it (the spec, the T line, the checks), so what the GPU waits for between steps
can be split into this and the CUDA calls (graph launch, event wait) that bench.decode_trace sees as the host gap.

    python -m bench.host_path [--tokens 20000]

Runs on the CPU (CuPy must import; no GPU is used): the backend is CUDABackend's code over a stub step whose launch
and pick read do nothing.
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace as NS


class _StubStep:
    """DecodeStep's surface the decode path calls, doing nothing (the pick: a function of the position)."""
    logits = None
    prefetch = None

    def launch(self, token, pos, pick, use_graph=True):
        pass

    def launch_next(self, pos, pick, use_graph=True):
        pass

    def pick_at(self, pos):
        return pos % 50, 0


def stub_backend(pipelined: bool, n_vocab: int = 1000):
    from engine.backend import Backend
    from engine.cuda.backend import CUDABackend
    from engine.cuda.pipeline import PipelineCounts
    from engine.cuda.trace import Tracer
    be = CUDABackend.__new__(CUDABackend)
    Backend.__init__(be, NS(config=NS(n_vocab=n_vocab, n_ctx_train=10 ** 7)), 10 ** 7)
    be.opts = NS(no_graph=False, adapt_every=0, expert_profile_save=None, expert_profile_save_every=0)
    be.pipelined, be._ahead, be._restorable, be.pipeline_counts = pipelined, None, [], PipelineCounts()
    be.cache = be.mem = be.recurrent_state = be.stream = None
    be._kv_high = be._tokens_since_adapt = 0
    be.kv, be.prefill, be.tracer = NS(), NS(lent=False, chunk=16), Tracer()
    be.step = be.decoder = _StubStep()
    # the family's own counters and facts (families/moe.py: none)
    be.family = NS(reset_stats=lambda: None, request_info=lambda: {}, info=lambda: {}, close=lambda: None)
    return be


def measure(pipelined: bool, tokens: int) -> dict:
    """us per token: backend.decode in a loop, and the session's request loop (T lines into a list)."""
    from engine.protocol import GenRequest
    from engine.sampling import PickSpec
    from engine.session import Session
    be = stub_backend(pipelined)
    be.n_cached = 10
    spec, tok = PickSpec(), 1
    t0 = time.perf_counter()
    for _ in range(tokens):
        tok = be.decode([tok], spec)[0].id
    decode_us = (time.perf_counter() - t0) / tokens * 1e6
    s = Session(be, ())
    s.tokens = [t % 1000 for t in range(be.n_cached)]
    lines = []
    t0 = time.perf_counter()
    done = s.run(GenRequest(tokens, s.tokens + [5]), lines.append)
    session_us = (time.perf_counter() - t0) / tokens * 1e6
    if done is None:
        raise RuntimeError(f"the stub request failed: {lines[-1]}")
    c = be.pipeline_counts
    return dict(decode_us=decode_us, session_us=session_us, kept=c.kept, ahead=c.ahead)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=20000)
    a = ap.parse_args(argv)
    for pipelined in (False, True):
        m = measure(pipelined, a.tokens)
        print(f"pipeline {'on ' if pipelined else 'off'}: backend.decode {m['decode_us']:.1f} us a token, the "
              f"session's loop over it {m['session_us']:.1f} us a token ({m['kept']} of {m['ahead']} steps run "
              f"ahead kept)")


if __name__ == "__main__":
    main()
