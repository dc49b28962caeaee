"""Comparisons the CUDA tests share: the CPU backend is the reference, and near-ties may part the greedy paths."""
import numpy as np

from engine.sampling import Sampler

# A CPU top-1/top-2 margin below this is a near-tie: fp16 activations may pick the other token from there on.
TIE = 1e-2


def rel_rows(a, b):
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def greedy(be, prompt, n):
    s = Sampler({})
    toks = [be.next_token(prompt, s)]
    while len(toks) < n:
        toks.append(be.next_token([toks[-1]], s))
    return toks


def assert_same_greedy(got, want, step_logits):
    """Equal tokens up to the first step where the CPU's margin was a near-tie (then the paths may part)."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top2 = np.sort(step_logits[i])[-2:]
            assert top2[1] - top2[0] < TIE, (f"step {i}: cuda {g} != cpu {w} with a clear CPU margin "
                                             f"{top2[1] - top2[0]:.4f}")
            return
    assert len(got) == len(want)
