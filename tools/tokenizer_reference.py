"""llama.cpp's token ids for a set of texts under a chosen pre-tokenizer: the fixture engine/tokenizer.py is checked by.

    python -m tools.tokenizer_reference --vocab V.gguf --pre qwen35 --out tests/data/qwen35-pretokenizer.json
        [--inp V.gguf.inp] [--llama-python /tmp/llamavenv/bin/python]

It copies the vocabulary GGUF with `tokenizer.ggml.pre` set to --pre (so a real merge table can stand in for a
vocabulary we do not ship), loads the copy in llama.cpp (llama-cpp-python's low-level API, vocabulary only, run by
--llama-python in a process of its own) and records, for each text of TEXTS (and of --inp, llama.cpp's own test
texts, separated by lines __ggml_vocab_test__), the ids llama_tokenize gives without
and with special-token parsing. The JSON names the source vocabulary and its sha256, so a test rebuilds the same
metadata from it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# Plain prose, code, numbers and whitespace runs, and the texts where qwen35's pattern differs from qwen2's:
# combining marks (Mn/Mc/Me) after letters, which qwen35 keeps inside the word.
TEXTS = [
    "Hello world", " Hello World!", "I'm sure they'll say it's fine, won't they?  I'd've", "HELLO'S 'TIS",
    "def f(x):\n    return x ** 2  # square\n\n\n\tdone", "3.14159 + 2718281828 = 12,345,678.90%",
    "   leading and trailing   ", "line one\r\nline two\n\n  \n", "a\u00a0b\u2003c\u3000d",
    "Caf\u00e9 cafe\u0301 na\u0308ive re\u0301sume\u0301", "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a \u0e42\u0e25\u0e01",
    "\u0645\u064e\u0631\u0652\u062d\u064e\u0628\u064b\u0627 \u0628\u0650\u0627\u0644\u0639\u064e\u0627\u0644\u064e\u0645",
    "\u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd", "Vi\u00ea\u0323t Nam ti\u00ea\u0301ng Vi\u00ea\u0323t",
    "\u0915\u094d\u0937\u0924\u094d\u0930\u093f\u092f 123 \u0967\u0968\u0969", "x\u20dd y\u0489 !\u0301?",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u3053\u3093\u306b\u3061\u306f \uc548\ub155\ud558\uc138\uc694",
    "emoji \U0001F600\U0001F44D\U0001F3FD and \u2764\ufe0f", "<think>\nreasoning\n</think>\n\nanswer",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "", " ", "\n", "'s", "a'S", "\u0301", "e\u0301\u0301\u0301x",
]

LLAMA_SIDE = r"""
import ctypes, json, sys
import llama_cpp as L
path, texts = sys.argv[1], json.load(sys.stdin)
L.llama_backend_init()
p = L.llama_model_default_params()
p.vocab_only = True
model = L.llama_model_load_from_file(path.encode(), p)
assert model, "llama.cpp could not load " + path
vocab = L.llama_model_get_vocab(model)
out = []
for text in texts:
    raw = text.encode("utf-8")
    row = {}
    for parse in (False, True):
        buf = (L.llama_token * (len(raw) + 8))()
        n = L.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, parse)
        assert n >= 0, n
        row["special" if parse else "plain"] = list(buf[:n])
    out.append(row)
L.llama_model_free(model)
json.dump(out, sys.stdout)
"""


def write_vocab_copy(src: Path, pre: str, dst: Path) -> None:
    import gguf
    from engine.gguf_model import read_header
    header = read_header(src)
    w = gguf.GGUFWriter(str(dst), arch=header.metadata.get("general.architecture", "llama"))
    for key, value in header.metadata.items():
        if key in ("general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"):
            continue
        types = header.types[key]
        if key == "tokenizer.ggml.pre":
            value = pre
        sub = types[1] if types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, types[0], sub_type=sub)
    if "tokenizer.ggml.pre" not in header.metadata:
        w.add_string("tokenizer.ggml.pre", pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=Path, required=True)
    ap.add_argument("--pre", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--inp", type=Path, help="more texts: a llama.cpp vocabulary test's .inp file")
    ap.add_argument("--llama-python", default="/tmp/llamavenv/bin/python")
    a = ap.parse_args(argv)
    texts = list(TEXTS)
    if a.inp:
        texts += a.inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "vocab.gguf"
        write_vocab_copy(a.vocab, a.pre, copy)
        p = subprocess.run([a.llama_python, "-c", LLAMA_SIDE, str(copy)], input=json.dumps(texts),
                           capture_output=True, text=True)
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)
            return 1
    rows = json.loads(p.stdout)
    doc = {"vocab": a.vocab.name, "vocab_sha256": hashlib.sha256(a.vocab.read_bytes()).hexdigest(), "pre": a.pre,
           "made_with": "llama-cpp-python 0.3.36 (llama.cpp 0c1e570), llama_tokenize(add_special=False)",
           "cases": [{"text": t, "ids": r["plain"], "ids_parse_special": r["special"]}
                     for t, r in zip(texts, rows)]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({k: v for k, v in doc.items() if k != "cases"}, ensure_ascii=False, indent=1)[:-2]
    cases = ",\n  ".join(json.dumps(c, ensure_ascii=False) for c in doc["cases"])   # one line a case
    a.out.write_text(f'{head},\n "cases": [\n  {cases}\n ]\n}}\n')
    print(f"{len(rows)} texts -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
