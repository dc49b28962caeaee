"""One table per model: Strata's decode and prompt figures beside llama.cpp's at each budget, from the --out files of
bench.decode, bench.prefill and bench.llama_bench (`python -m bench.vs_llama DECODE.json PREFILL.json LLAMA.jsonl`).

A budget Strata ran with is compared with llama.cpp's row of the same budget; the VRAM llama.cpp really used is in
its column, since -ncmoe moves whole layers and lands near the budget, not on it."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load(decode: Path, prefill: Path, llama: Path) -> list[dict]:
    dec = {str(r["budget"]): r for r in json.loads(decode.read_text())["rows"]} if decode.is_file() else {}
    pre = {}
    if prefill.is_file():
        for r in json.loads(prefill.read_text())["rows"]:
            if r.get("prompt") == 4096:
                pre[str(r["budget"])] = r
    ref = {}
    if llama.is_file():
        for line in llama.read_text().splitlines():
            r = json.loads(line)
            ref[str(r["budget"])] = r
    rows = []
    for b in dict.fromkeys([*dec, *pre, *ref]):
        d, p, r = dec.get(b, {}), pre.get(b, {}), ref.get(b, {})
        rows.append(dict(budget=b, decode=d.get("tok_s"), hit=d.get("hit_rate"), prompt=p.get("tok_s"),
                         l_vram=r.get("vram_gib"), l_ncmoe=r.get("ncmoe"), l_decode=r.get("tg_tok_s"),
                         l_prompt=r.get("pp_tok_s")))
    return rows


def memory_note(decode: Path) -> str | None:
    """A line under the table when Strata ran in a memory mode (bench.decode --resident-budget-gib): its misses
    were not all read from a whole pinned arena."""
    if not decode.is_file():
        return None
    f = json.loads(decode.read_text()).get("facts", {})
    if f.get("memory", "pinned") == "pinned":
        return None
    return (f"Strata's experts in host RAM: memory mode {f['memory']}, {f.get('experts_pinned')} experts pinned "
            f"({f.get('arena_gib')} GiB), the rest read from the model file (file MB a token in the decode rows)")


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def _x(a, b):
    return "-" if a is None or not b else f"{a / b:.2f}x"


def table(rows: list[dict]) -> str:
    out = ["| budget GiB | decode tok/s | hit rate | llama.cpp tg | ratio | prompt 4K tok/s | llama.cpp pp4096 | ratio "
           "| llama.cpp -ncmoe | its VRAM GiB |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['budget']} | {_f(r['decode'], '.1f')} | {_f(r['hit'], '.3f')} | {_f(r['l_decode'], '.1f')} "
                   f"| {_x(r['decode'], r['l_decode'])} | {_f(r['prompt'], ',.0f')} | {_f(r['l_prompt'], ',.0f')} "
                   f"| {_x(r['prompt'], r['l_prompt'])} | {_f(r['l_ncmoe'], 'd')} | {_f(r['l_vram'], '.1f')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print(__doc__.split("\n")[0], file=sys.stderr)
        print("usage: python -m bench.vs_llama DECODE.json PREFILL.json LLAMA.jsonl", file=sys.stderr)
        return 2
    print(table(load(*map(Path, argv))))
    note = memory_note(Path(argv[0]))
    if note:
        print(f"\n{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
