"""Comparisons the CUDA tests share: the CPU backend is the reference, and near-ties may part the greedy paths."""
import json

import numpy as np

from engine.backend_cpu import CPUBackend
from engine.gguf_model import open_model
from engine.sampling import PickSpec
from route_ties import Reference, greedy_reference, gpu_routes

# A CPU top-1/top-2 margin below this is a near-tie: fp16 activations may pick the other token from there on.
TIE = 1e-2


def rel(a, b):
    """The relative error of a against b as a whole, in fp64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def rel_rows(a, b):
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def greedy(be, prompt, n):
    spec = PickSpec()
    toks = [be.decode(prompt, spec)[0].id]
    while len(toks) < n:
        toks.append(be.decode([toks[-1]], spec)[0].id)
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


def assert_pass_and_decode_match(be, model, ctx, prompt, toks, cpu_logits, tol=1e-2):
    """prompt + toks[:-1] teacher-forced through the prompt pass (its tracer a route_ties.RouteRecorder: the reference
    follows the pass's routes where its fp16 GEMMs part a near-tie), within tol of that reference row by row; then the
    same positions one token at a time through the decode step, each row within tol of one valid routing: the plain
    one (cpu_logits[1:], cpu_runs' step logits) or the one whose prompt positions parted."""
    seq = prompt + toks[:-1]
    be.tracer.routes = []
    lg = be.forward(seq, all_logits=True)[len(prompt) - 1:]
    assert np.isfinite(lg).all()
    ref = Reference(model, ctx, gpu_routes(be.tracer.routes))
    be.tracer.routes = None
    want = ref.forward(seq, all_logits=True)[len(prompt) - 1:]
    ref.close()
    assert ref.clear_parts() == [], ref.parted
    assert rel_rows(lg, want).max() < tol
    be.truncate(len(prompt))
    dec = np.stack([be.forward([t]) for t in toks[:-1]])
    assert np.minimum(rel_rows(dec, cpu_logits[1:]), rel_rows(dec, want[1:])).max() < tol


def cpu_greedy(model, prompt, n, ctx):
    """The NumPy backend's greedy continuation of prompt: n tokens, and the logits (n, vocab) each was picked from."""
    cpu = CPUBackend(model, ctx)
    try:
        return greedy_reference(cpu, prompt, n)     # its loop needs only forward(), which CPUBackend has
    finally:
        cpu.close()


def cpu_teacher_run(model, prompt, n, ctx):
    """The NumPy backend's greedy continuation of prompt: n tokens, and the logits of every prompt row followed by
    those each token was picked from, (len(prompt) + n - 1, vocab): what a prompt pass plus decode must reproduce."""
    cpu = CPUBackend(model, ctx)
    try:
        logits = [cpu.forward(prompt, all_logits=True)]
        toks = []
        for _ in range(n):
            toks.append(int(np.argmax(logits[-1][-1])))
            logits.append(cpu.forward([toks[-1]], all_logits=True))
    finally:
        cpu.close()
    return toks, np.concatenate(logits[:-1], axis=0)


def cpu_runs(fixtures_dir, names, n, ctx):
    """Per fixture model: the model, its reference prompt, the CPU's greedy continuation and each step's logits."""
    out = {}
    for name in names:
        model = open_model(fixtures_dir / "reference" / f"{name}.gguf")
        case = json.loads((fixtures_dir / "reference" / f"{name}.json").read_text())["cases"][0]
        prompt = list(case["prompt_ids"])
        out[name] = (model, prompt, *cpu_greedy(model, prompt, n, ctx))
    return out
