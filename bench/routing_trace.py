"""Routing traces: which experts each token routed to in each layer, recorded once, read by bench.plan.

A trace is a JSON file (gzip-compressed when its name ends in .gz):

    {"format": "strata-routing-trace", "version": 1,
     "n_layer": L, "n_expert": E, "n_expert_used": k, "source": "how it was recorded",
     "sequences": [[[[e, ...k ids], ...L layers], ...tokens], ...sequences]}

A sequence is one prompt's tokens in order (a decode follows one sequence). Every token lists, for every layer, the
k expert ids it routed to (in no particular order); a layer without routed experts lists none. `python -m bench.routing
... --trace-out PATH` records one; tests/fixtures/routing/ holds one made from the tiny preset's model.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT, VERSION = "strata-routing-trace", 1


class TraceError(ValueError):
    """A trace file that cannot be used; the message says which file and why."""


@dataclass
class Trace:
    n_layer: int
    n_expert: int
    n_expert_used: int
    sequences: list[np.ndarray]     # each (T, L, k) int: the ids (-1 where a layer routes nothing)
    source: str = ""

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def from_layers(ids_per_layer: list[np.ndarray], n_expert: int, source: str) -> Trace:
    """A trace from per-layer routing, ids_per_layer[l] of shape (n_sequences, T, k)."""
    ids = np.stack([np.asarray(a) for a in ids_per_layer], axis=2)     # (S, T, L, k)
    S, T, L, k = ids.shape
    return Trace(L, n_expert, k, [ids[s] for s in range(S)], source)


def write(trace: Trace, path) -> None:
    path = Path(path)
    doc = {"format": FORMAT, "version": VERSION, "n_layer": trace.n_layer, "n_expert": trace.n_expert,
           "n_expert_used": trace.n_expert_used, "source": trace.source,
           "sequences": [[[[int(e) for e in layer if e >= 0] for layer in tok] for tok in seq]
                         for seq in trace.sequences]}
    text = json.dumps(doc, separators=(",", ":"))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text + "\n")


def read(path) -> Trace:
    path = Path(path)
    try:
        raw = path.read_bytes()
        doc = json.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)
    except OSError as e:
        raise TraceError(f"cannot read routing trace {path}: {e.strerror or e}") from None
    except (ValueError, EOFError) as e:
        raise TraceError(f"{path} is not a routing trace (JSON{', gzip' if path.name.endswith('.gz') else ''}): "
                         f"{e}; record one with python -m bench.routing ... --trace-out PATH") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise TraceError(f"{path} is not a {FORMAT} version {VERSION} file; record one with bench.routing --trace-out")
    try:
        L, E, k = (int(doc[key]) for key in ("n_layer", "n_expert", "n_expert_used"))
        seqs = []
        for s in doc["sequences"]:
            arr = np.full((len(s), L, k), -1, np.int64)
            for t, tok in enumerate(s):
                if len(tok) != L:
                    raise ValueError(f"a token lists {len(tok)} layers, not {L}")
                for il, layer in enumerate(tok):
                    if len(layer) not in (0, k):
                        raise ValueError(f"layer {il} of a token lists {len(layer)} experts, not {k} (or none)")
                    arr[t, il, :len(layer)] = layer
            if arr.size and (arr.max() >= E or arr.min() < -1):
                raise ValueError(f"expert ids outside 0..{E - 1}")
            seqs.append(arr)
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{path}: a malformed routing trace ({e}); record it again with bench.routing") from None
    if not seqs or not any(len(s) for s in seqs):
        raise TraceError(f"{path} holds no tokens")
    return Trace(L, E, k, seqs, str(doc.get("source", "")))
