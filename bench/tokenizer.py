"""Tokenizer speed: encode about 1 MB of mixed text (English prose, code, numbers, Cyrillic, CJK, emoji) and print
tokens/s, cold (empty word cache) and warm.

    python -m bench.tokenizer [VOCAB.gguf] [--mb 1.0]

Default vocabulary: the fixtures' qwen2 one. The text is generated (seeded), so that most words are new to the cache,
as in a real document, rather than one sentence repeated.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VOCAB = ROOT.parent / "shared" / "fixtures" / "vocab" / "ggml-vocab-qwen2.gguf"

_EN = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
       "you were her she there been one all we their has would when if so no will more can said what about up out "
       "tokenizer expert cache memory bandwidth pinned arena stream kernel routing").split()
_RU = "и в не на я что тот быть с он а весь это как она по но они к у ты из мы за вы так же от сказать".split()
_CODE = ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }\n",
         "if err != nil {\n\treturn err\n}\n", "    let y = vec![1, 2, 3];\n", "<div class=\"x\">&nbsp;</div>\n"]


def mixed_text(n_bytes: int, seed: int = 0) -> str:
    rnd = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        k = rnd.random()
        if k < 0.55:
            s = " ".join(rnd.choice(_EN) + ("" if rnd.random() < 0.9 else rnd.choice(",.;:!?"))
                         for _ in range(rnd.randint(5, 30))) + ".\n"
        elif k < 0.7:
            s = " ".join(rnd.choice(_RU) for _ in range(rnd.randint(5, 20))) + ".\n"
        elif k < 0.8:
            s = "".join(chr(rnd.randint(0x4E00, 0x9FA5)) for _ in range(rnd.randint(10, 60))) + "。\n"
        elif k < 0.9:
            s = rnd.choice(_CODE)
        elif k < 0.95:
            s = " ".join(str(rnd.randint(0, 10 ** rnd.randint(1, 9))) for _ in range(rnd.randint(3, 12))) + "\n"
        else:
            s = "".join(chr(rnd.randint(0x1F300, 0x1F64F)) for _ in range(rnd.randint(1, 6))) + " \n"
        parts.append(s)
        size += len(s.encode())
    return "".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tokenizer", description=__doc__.splitlines()[0])
    ap.add_argument("vocab", nargs="?", default=str(DEFAULT_VOCAB))
    ap.add_argument("--mb", type=float, default=1.0, help="megabytes of text (default 1)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(args.vocab)
    load_s = time.perf_counter() - t0
    text = mixed_text(int(args.mb * 1_000_000))
    n_bytes = len(text.encode())

    rows = []
    for label in ("cold", "warm"):
        t0 = time.perf_counter()
        ids = tok.encode(text, add_special=False)
        dt = time.perf_counter() - t0
        rows.append((label, len(ids), dt))
    assert tok.decode(ids) == text, "round trip failed"

    print(f"vocabulary {Path(args.vocab).name} ({tok.n_vocab} tokens, pre={tok.pre or tok.model}), "
          f"loaded in {load_s:.2f} s; text {n_bytes / 1e6:.2f} MB")
    print(f"{'pass':<6}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}{'MB/s':>8}")
    for label, n, dt in rows:
        print(f"{label:<6}{n:>10}{dt:>10.2f}{n / dt:>12,.0f}{n_bytes / 1e6 / dt:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
