"""Strata beside llama.cpp at long contexts, one budget: decode after a prompt of N tokens (bench.decode --prompt N)
against llama-bench's tg at -d N, and the prompt rows (bench.decode --prefill-out) against llama-bench's pp where it
has one (`python -m bench.vs_llama_ctx --budget 12 --decode 32768=D.json --llama 32768=L.jsonl --prefill P.json`).

llama.cpp's rows may be at another budget than Strata's (a deep prompt pass with experts on the CPU takes minutes):
each row says the budget and -ncmoe llama.cpp ran at, and the ratio is printed only beside a row of the same budget."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _pairs(items: list[str], what: str) -> dict[int, Path]:
    out = {}
    for it in items:
        n, sep, path = it.partition("=")
        if not sep or not n.isdigit():
            raise SystemExit(f"bench.vs_llama_ctx: {what} takes CONTEXT=FILE, not {it!r}")
        out[int(n)] = Path(path)
    return out


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    if path.suffix == ".jsonl":
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return json.loads(path.read_text())["rows"]


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def table(budget: str, decode: dict[int, Path], llama: dict[int, Path], prefill: Path | None) -> str:
    out = ["| what | Strata tok/s | ceiling | hit rate | llama.cpp tok/s | its budget | -ncmoe | its VRAM GiB | ratio |",
           "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for n in sorted(set(decode) | set(llama)):
        s = next((r for r in _rows(decode[n]) if str(r["budget"]) == budget), {}) if n in decode else {}
        refs = _rows(llama[n]) if n in llama else []
        # the budget's own row when llama.cpp reached it, else its all-in-VRAM row
        ref = next((r for r in refs if str(r["budget"]) == budget), None) or next(
            (r for r in refs if r["budget"] == "all"), {})
        same = str(ref.get("budget")) == budget
        tg = ref.get("tg_tok_s")
        ratio = f"{s['tok_s'] / tg:.2f}x" if same and s.get("tok_s") and tg else "-"
        # bench.decode's ceilings: the link's for the row's misses, HBM's for the bytes a step reads
        caps = [s[k] for k in ("pcie_ceiling_tok_s", "hbm_ceiling_tok_s") if s.get(k) is not None]
        out.append(f"| decode at {n:,} | {_f(s.get('tok_s'), '.1f')} | {_f(min(caps, default=None), ',.0f')} | "
                   f"{_f(s.get('hit_rate'), '.3f')} | "
                   f"{_f(tg, '.1f')} | {ref.get('budget', '-')} | {_f(ref.get('ncmoe'), 'd')} | "
                   f"{_f(ref.get('vram_gib'), '.1f')} | {ratio} |")
    for r in _rows(prefill) if prefill else []:
        if str(r["budget"]) == budget:
            out.append(f"| prompt {r['prompt']:,} | {r['tok_s']:,.0f} | - | - | - | - | - | - | - |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", required=True, help="Strata's budget in GiB (or all)")
    ap.add_argument("--decode", action="append", default=[], metavar="CONTEXT=FILE", help="bench.decode --out")
    ap.add_argument("--llama", action="append", default=[], metavar="CONTEXT=FILE", help="bench.llama_bench --out")
    ap.add_argument("--prefill", type=Path, help="bench.decode --prefill-out")
    a = ap.parse_args(argv)
    print(table(a.budget, _pairs(a.decode, "--decode"), _pairs(a.llama, "--llama"), a.prefill))
    return 0


if __name__ == "__main__":
    sys.exit(main())
