"""The model catalog (data/catalog.json) and what each model needs from a PC: disk, RAM, VRAM, memory mode.

The arithmetic, in one place so the wizard's advice can be checked against it:
- expert bytes = file bytes x expert_share (routed experts); dense bytes = the rest (attention, embeddings, norms).
- KV = kv_bytes_per_token x context (f16 K and V of the full-attention layers).
- VRAM, CUDA backend: dense bytes + KV + compute workspace + CUDA context + the reserve left free
  (--vram-reserve-mib). Experts need no VRAM (they are read over PCIe from pinned RAM); what VRAM is left caches
  the hottest ones. The worker runs on one GPU (it has no layer split yet), so VRAM is judged per card: the
  largest one (best_gpu), never the sum.
- RAM: the OS and other programs keep max(4 GiB, 15%) of it; the worker process needs about 1.5 GiB of its own.
  Memory modes, from what is left (the "RAM budget"): every expert pinned in RAM ("ram") when they fit; else the
  hottest N GiB pinned, the rest read from the GGUF ("budget", --resident-budget-gib N) when N is a useful share;
  else every expert read through the OS file cache ("mmap", --mmap-experts, slowest).
- A hashed n-gram table (qwen4exp's per_layer_token_embd, table bytes = file bytes x table_share) is never loaded:
  each token reads its 16 rows from the file through a bounded row cache (TABLE_ROW_CACHE of RAM), so it needs
  disk only, neither RAM nor VRAM; dense bytes exclude it.
- A CUDA preview (engine/supported.py CUDA_PREVIEW_ARCHS: the worker runs it on CUDA, its speed not yet measured
  on the GPU machine) is offered where the PC fits it, said so in the offer, and never recommended automatically:
  the person names or picks it.
- The CPU backend (no GPU) holds the whole model plus KV in RAM; it is the NumPy reference, so a model beyond a few
  GiB does not "fit" there in any useful sense (tokens would take many seconds each), and the wizard says so.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.supported import CUDA_PREVIEW_ARCHS, SUPPORTED_ARCHS, archs_for, runs_on

from .machine import GIB, MIB, Machine

ROOT = Path(__file__).resolve().parent.parent
CATALOG_PATH = ROOT / "data" / "catalog.json"

WORKER_OVERHEAD = int(1.5 * GIB)      # Python, NumPy/CuPy, buffers of the worker process itself
CUDA_CONTEXT = 400 * MIB              # what creating a CUDA context takes on the card
GPU_WORKSPACE = 512 * MIB             # activations, prompt-chunk buffers, the expert staging ring's minimum
DISK_MARGIN = 1 * GIB                 # never fill a disk to the last byte
MIN_BUDGET_SHARE = 0.2                # below this share of the experts pinned, "budget" is no better than mmap
CPU_MAX_BYTES = 4 * GIB               # model size the NumPy CPU backend runs at a usable speed (a few tok/s)
CPU_MAX_ACTIVE_B = 1.0                # billions of parameters read per token, likewise
# The row cache an n-gram table is read through (issue 29 item 1: bounded, RSS does not grow with the table). Each
# token reads 16 rows of 160 values (under 3 KiB at 4-bit), so 1 GiB keeps the hot rows of a long session.
TABLE_ROW_CACHE = 1 * GIB
TABLE_TENSORS = {"qwen4exp": "per_layer_token_embd."}   # arch -> the table's tensor name prefix


class CatalogError(ValueError):
    pass


@dataclass
class CatalogFile:
    name: str                          # path inside the repository (may have a folder, e.g. Q4_K_M/x-00001-of-00003.gguf)
    size: int | None = None
    sha256: str | None = None

    @property
    def basename(self) -> str:
        return self.name.rsplit("/", 1)[-1]


@dataclass
class CatalogModel:
    name: str
    title: str
    source: str                        # "hf" or "pypi"
    arch: str                          # the GGUF's general.architecture
    recipe: str                        # llama-quantize's recipe (file type): Q4_K_M, Q8_0, ...
    files: list[CatalogFile]
    params_b: float
    active_b: float
    expert_share: float
    kv_bytes_per_token: int
    ctx_train: int
    default_ctx: int
    preference: int = 0
    repo: str | None = None
    revision: str = "main"
    pypi: str | None = None
    total_bytes: int | None = None
    size_exact: bool = False
    size_note: str = ""
    license: str = ""
    table_share: float = 0.0           # bytes in a hashed n-gram table read by row from the file (qwen4exp's PLE)

    @property
    def size(self) -> int:
        known = [f.size for f in self.files]
        if all(s is not None for s in known):
            return sum(known)
        if self.total_bytes is None:
            raise CatalogError(f"catalog entry {self.name} has files of unknown size and no total_bytes")
        return self.total_bytes

    @property
    def is_moe(self) -> bool:
        return self.expert_share > 0

    @property
    def supported(self) -> bool:
        """Whether this engine runs the architecture (engine/supported.py: the list open_model checks)."""
        return self.arch in SUPPORTED_ARCHS

    @property
    def first_file(self) -> CatalogFile:
        return self.files[0]


def load_catalog(path: Path = CATALOG_PATH) -> list[CatalogModel]:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CatalogError(f"cannot read the model catalog {path}: {e}") from None
    models = []
    for entry in raw.get("models", []):
        entry = dict(entry)
        files = [CatalogFile(**f) for f in entry.pop("files")]
        try:
            m = CatalogModel(files=files, **entry)
        except TypeError as e:
            raise CatalogError(f"catalog entry {entry.get('name', '?')} in {path}: {e}") from None
        if m.source == "hf" and not m.repo:
            raise CatalogError(f"catalog entry {m.name} comes from the hub but names no repo")
        models.append(m)
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise CatalogError(f"duplicate model names in {path}")
    return models


def find_model(models: list[CatalogModel], name: str) -> CatalogModel:
    for m in models:
        if m.name == name.lower():
            return m
    raise CatalogError(f"no model named {name!r} in the catalog; choose one of: {', '.join(m.name for m in models)}")


def model_from_gguf(path: Path) -> CatalogModel:
    """A catalog-like entry for a GGUF the person already has, measured from its own tensor table."""
    # imported here: `--check` must work before the packages step installed gguf and numpy. The engine's reader,
    # not gguf.GGUFReader: that one fails on Q2_0 tensors and takes ~20 s on a 150k-token vocabulary.
    from engine.gguf_model import ModelError, read_header
    from engine.quant_types import SIZES
    path = Path(path)
    parts = split_parts(path)
    total = expert = table = 0
    meta: dict = {}
    for i, p in enumerate(parts):
        try:
            h = read_header(p)
        except ModelError as e:
            raise CatalogError(f"{p} is not a readable GGUF ({e})") from None
        if i == 0:
            meta = {k: v for k, v in h.metadata.items() if not isinstance(v, list)}
        total += p.stat().st_size
        prefix = TABLE_TENSORS.get(meta.get("general.architecture"))
        for t in h.tensors:
            if t.type_id not in SIZES:
                raise CatalogError(f"{p} is not a readable GGUF (tensor {t.name} has quant type id {t.type_id}, "
                                   f"which ggml does not have)")
            block, size = SIZES[t.type_id]
            nbytes = t.dims[0] // block * size * math.prod(t.dims[1:])
            if "_exps." in t.name:
                expert += nbytes
            if prefix and t.name.startswith(prefix):
                table += nbytes
    arch = meta.get("general.architecture", "unknown")
    n_layer = int(meta.get(f"{arch}.block_count", 0))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", meta.get(f"{arch}.attention.head_count", 0)))
    n_embd = int(meta.get(f"{arch}.embedding_length", 0))
    n_head = int(meta.get(f"{arch}.attention.head_count", 1)) or 1
    k_len = int(meta.get(f"{arch}.attention.key_length", n_embd // n_head if n_head else 0))
    v_len = int(meta.get(f"{arch}.attention.value_length", k_len))
    ctx_train = int(meta.get(f"{arch}.context_length", 4096))
    name = path.name.removesuffix(".gguf")
    if len(parts) > 1:
        name = name.rsplit("-00001-of-", 1)[0]
    # The name becomes part of file names (strata-<name>.json): keep it to safe characters.
    name = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-") or "model"
    return CatalogModel(
        name=name, title=f"{path.name} (your file)", source="local", arch=arch, recipe="",
        files=[CatalogFile(str(p), p.stat().st_size, None) for p in parts], params_b=0.0, active_b=0.0,
        expert_share=expert / total if total else 0.0, kv_bytes_per_token=n_layer * n_kv * (k_len + v_len) * 2,
        ctx_train=ctx_train, default_ctx=min(ctx_train, 32768), size_exact=True, size_note="measured from the file",
        table_share=table / total if total else 0.0)


def split_parts(path: Path) -> list[Path]:
    """All files of a split set given its first part (`x-00001-of-00003.gguf`), or [path]."""
    path = Path(path)
    stem = path.name
    if "-00001-of-" in stem and stem.endswith(".gguf"):
        head, tail = stem.rsplit("-00001-of-", 1)
        n = int(tail.removesuffix(".gguf"))
        parts = [path.with_name(f"{head}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
        missing = [p.name for p in parts if not p.is_file()]
        if missing:
            raise CatalogError(f"split set {path.name} is incomplete: missing {', '.join(missing)} in {path.parent}")
        return parts
    if not path.is_file():
        raise CatalogError(f"no GGUF at {path}")
    return [path]


# --- what a model needs, and whether this PC has it ------------------------------------------------------------

@dataclass
class Needs:
    model: CatalogModel
    backend: str                   # "cuda" or "cpu"
    ctx: int
    download: int                  # bytes still to fetch
    disk_ok: bool
    expert_bytes: int
    dense_bytes: int                # everything else but the n-gram table: on the GPU with the KV
    kv_bytes: int
    vram_need: int                 # bytes (0 on the CPU backend)
    vram_have: int
    ram_budget: int                # bytes of RAM the worker may use
    mode: str                      # "ram" | "budget" | "mmap" | "cpu"
    resident_gib: int = 0          # for mode "budget"
    fits: bool = False
    problems: list[str] = field(default_factory=list)   # plain reasons it does not fit
    warnings: list[str] = field(default_factory=list)   # it fits, but...
    table_bytes: int = 0           # a hashed n-gram table, read by row from the file: disk only

    @property
    def supported(self) -> bool:
        """Whether the backend this PC would use runs the model's architecture (engine/supported.py), a CUDA
        preview counted: the worker runs it there (strata_worker.py checks runs_on(..., preview=True))."""
        return runs_on(self.model.arch, self.backend) or self.preview

    @property
    def preview(self) -> bool:
        """Whether the CUDA backend runs this architecture only as a preview (not yet measured on a GPU)."""
        return is_preview(self.model.arch, self.backend)

    @property
    def ram_need(self) -> int:
        """RAM the chosen mode takes (what the table shows); an n-gram table adds its row cache, never itself."""
        own = WORKER_OVERHEAD + (TABLE_ROW_CACHE if self.table_bytes else 0)
        if self.mode == "cpu":
            return self.expert_bytes + self.dense_bytes + self.kv_bytes + own
        if self.mode == "ram":
            return self.expert_bytes + own
        if self.mode == "budget":
            return self.resident_gib * GIB + own
        return own


def is_preview(arch: str, backend: str) -> bool:
    return backend == "cuda" and arch in CUDA_PREVIEW_ARCHS and not runs_on(arch, backend)


PREVIEW_NOTE = ("CUDA support for {arch} is a preview: the service runs it on the GPU, but its speed at this size "
                "has not been measured yet (engine/supported.py CUDA_PREVIEW_ARCHS), so it is offered, not recommended")


def unsupported_reason(arch: str, backend: str) -> str:
    if backend == "cuda" and arch in SUPPORTED_ARCHS:
        return (f"not supported yet: this engine does not run the {arch} architecture on the GPU yet (only on the "
                f"CPU backend, far too slowly for a model this size; the GPU runs {', '.join(archs_for('cuda'))})")
    return (f"not supported yet: this engine does not run the {arch} architecture "
            f"(it runs {', '.join(archs_for(backend))})")


def best_gpu(m: Machine):
    """The card the worker runs on: the one with the most VRAM (the first of equals)."""
    return max(m.gpus, key=lambda g: (g.vram_total_mib, -g.index))


def ram_budget(m: Machine) -> int:
    return max(0, m.ram_total - max(4 * GIB, int(0.15 * m.ram_total)))


def memory_mode(expert_bytes: int, budget: int, reserved: int = 0) -> tuple[str, int]:
    """('ram', 0) | ('budget', N GiB) | ('mmap', 0) for experts of expert_bytes and a RAM budget, `reserved`
    bytes of which something else takes (an n-gram table's row cache)."""
    room = budget - WORKER_OVERHEAD - reserved
    if expert_bytes <= room:
        return "ram", 0
    n = int(room // GIB)
    if n >= 2 and n * GIB >= MIN_BUDGET_SHARE * expert_bytes:
        return "budget", n
    return "mmap", 0


def assess(model: CatalogModel, m: Machine, backend: str | None = None, ctx: int | None = None,
           vram_reserve_mib: int = 700, already: int = 0) -> Needs:
    """What `model` needs on machine `m`; backend None picks cuda when there is a GPU. `already`: bytes on disk."""
    backend = backend or ("cuda" if m.has_gpu else "cpu")
    ctx = ctx or model.default_ctx
    size = model.size
    expert = int(size * model.expert_share)
    table = int(size * model.table_share)
    dense = size - expert - table
    kv = model.kv_bytes_per_token * ctx
    download = max(0, size - already)
    budget = ram_budget(m)
    n = Needs(model=model, backend=backend, ctx=ctx, download=download,
              disk_ok=download + DISK_MARGIN <= m.disk_free if download else True,
              expert_bytes=expert, dense_bytes=dense, kv_bytes=kv, vram_need=0, vram_have=0,
              ram_budget=budget, mode="cpu", table_bytes=table)
    row_cache = TABLE_ROW_CACHE if table else 0
    if table:
        n.warnings.append(f"the {fmt_gb(table)} n-gram table stays on the disk: every token reads 16 of its rows "
                          f"from the file (a {fmt_gib(row_cache)} row cache keeps the hot ones), so keep the model "
                          f"on an SSD")
    if not n.disk_ok:
        n.problems.append(f"needs {download / 1e9:.1f} GB of disk, {m.disk_free / 1e9:.1f} GB free at {m.disk_path}")
    if ctx > model.ctx_train:
        n.warnings.append(f"context {ctx} is beyond what the model was trained for ({model.ctx_train})")
    if not n.supported:
        n.problems.append(unsupported_reason(model.arch, backend))
    elif n.preview:
        n.warnings.insert(0, PREVIEW_NOTE.format(arch=model.arch))
    if backend == "cuda":
        if not m.has_gpu:
            n.problems.append("the CUDA backend needs an NVIDIA GPU and none was found")
            return n
        gpu = best_gpu(m)
        n.vram_need = dense + kv + GPU_WORKSPACE + CUDA_CONTEXT + vram_reserve_mib * MIB
        n.vram_have = gpu.vram_total_mib * MIB
        if n.vram_need > n.vram_have:
            card = f"GPU {gpu.index}, the largest of {len(m.gpus)}," if len(m.gpus) > 1 else "the GPU"
            n.problems.append(f"needs {n.vram_need / GIB:.1f} GiB of VRAM for attention, embeddings and KV "
                              f"at context {ctx}; {card} has {n.vram_have / GIB:.1f} GiB (a smaller --ctx needs less"
                              f"{'; the worker uses one GPU, so cards do not add up' if len(m.gpus) > 1 else ''})")
        if model.is_moe:
            n.mode, n.resident_gib = memory_mode(expert, budget, row_cache)
            if n.mode == "budget":
                n.warnings.append(f"RAM holds {n.resident_gib} GiB of the {expert / GIB:.1f} GiB of experts; "
                                  f"the rest are read from the disk (slower)")
            elif n.mode == "mmap":
                n.warnings.append(f"RAM ({m.ram_total / GIB:.0f} GiB) is far below the experts "
                                  f"({expert / GIB:.1f} GiB): every expert is read through the disk cache "
                                  f"(much slower)")
        else:
            n.mode = "ram"
            if size - table + WORKER_OVERHEAD + row_cache > budget:
                n.problems.append(f"needs {(size - table + WORKER_OVERHEAD + row_cache) / GIB:.1f} GiB of RAM, "
                                  f"{budget / GIB:.1f} GiB usable")
    else:
        if size > CPU_MAX_BYTES or model.active_b > CPU_MAX_ACTIVE_B:
            n.problems.append(f"too large for the CPU backend (the NumPy reference, usable up to about "
                              f"{fmt_gib(CPU_MAX_BYTES)} of model): it needs an NVIDIA GPU")
        if n.ram_need > budget:
            n.problems.append(f"needs {n.ram_need / GIB:.1f} GiB of RAM on the CPU backend, "
                              f"{budget / GIB:.1f} GiB usable")
    n.fits = not n.problems
    return n


def recommend(needs: list[Needs]) -> Needs:
    """The model to suggest: the most preferred one that fits with every expert in RAM; else the default model.
    A CUDA preview is never suggested: it is offered, for the person to pick."""
    good = [n for n in needs if n.fits and n.supported and not n.preview and n.mode in ("ram", "cpu")
            and n.model.preference > 0]
    if good:
        return max(good, key=lambda n: n.model.preference)
    default = [n for n in needs if n.model.source == "pypi"]
    if not default:
        raise CatalogError("the catalog has no default (PyPI) model")
    return default[0]


def fmt_gb(b: int) -> str:
    return f"{b / 1e9:.1f} GB" if b >= 1e9 else f"{b / 1e6:.0f} MB"


def fmt_gib(b: int) -> str:
    return f"{b / GIB:.1f} GiB" if b >= GIB else f"{math.ceil(b / MIB)} MiB"
