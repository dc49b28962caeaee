"""Open a GGUF model (one file or a split set): validated header, hyperparameters, memory-mapped tensors.

The header is read by our own small bounds-checked reader, read_header (the tokenizer and tools.make_moe use it
too), so that a text file, a truncated download or an unknown quant type gives one clear ModelError (and a 150k
vocabulary loads in a quarter of a second); the tensor data is an np.memmap of the file, and the gguf package
supplies the quant types, block sizes and the reference dequantizer.
Names and metadata keys are llama.cpp's, so that one GGUF runs in both.
"""
from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES
import gguf.quants

from engine.supported import SUPPORTED_ARCHS  # noqa: F401  (re-exported: engine.arch and the tests import it here)

# Gated DeltaNet + gated attention hybrids (engine/arch/qwen3next.py); their tensors are checked there.
HYBRID_ARCHS = ("qwen3next", "qwen35moe")
QTYPE_NAMES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "MXFP4")
# An older gguf package may lack the newest types (MXFP4 came with gpt-oss): those are then refused by name.
SUPPORTED_QTYPES = frozenset(QT[n] for n in QTYPE_NAMES if n in QT.__members__)
EXPERT_KINDS = ("gate", "up", "down")
GGUF_MAGIC = b"GGUF"
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class ModelError(Exception):
    """A model file that cannot be used; the message is one line that says what is wrong and what to do."""


@dataclass
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int            # per-head width of Q and K
    head_dim_v: int          # per-head width of V
    n_ff: int                # dense FFN width (0 when every layer has experts)
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_type: str           # "norm": rotate pairs (2i, 2i+1) (llama); "neox": pairs (i, i + n_rot/2) (qwen)
    n_rot: int               # leading dimensions of each head that RoPE turns
    rope_scaling: str = "none"   # "none" | "linear" | "yarn"
    rope_freq_scale: float = 1.0  # 1 / scaling factor
    rope_n_ctx_orig: int = 0
    yarn_ext_factor: float = 0.0
    yarn_attn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    attn_scale: float = 0.0      # 0: 1/sqrt(head_dim)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    expert_weights_norm: bool = False   # renormalize the top-k router weights to sum 1
    expert_weights_scale: float = 1.0
    qk_norm: bool = False
    attn_bias: bool = False
    tied_embeddings: bool = False
    shared_expert: bool = False
    shared_expert_gate: bool = False
    n_swa: int = 0                      # sliding-window width (gpt-oss); 0: every layer attends to all
    swa_layers: tuple[bool, ...] = ()   # per layer: does it use the window

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]
    # The hybrids (qwen3next, qwen35moe). n_layer counts the trunk only; block_count = n_layer + n_layer_nextn.
    n_layer_nextn: int = 0       # MTP (next-token) blocks after the trunk, loaded but not run by the main pass
    recurrent_layers: tuple = () # per trunk layer: True = Gated DeltaNet, False = gated full attention
    ssm_conv: int = 0            # causal conv1d kernel width (d_conv)
    ssm_inner: int = 0           # value width of a GDN layer: ssm_v_heads * head_v_dim
    ssm_state: int = 0           # head_k_dim = head_v_dim
    ssm_v_heads: int = 0         # ssm.time_step_rank
    ssm_k_heads: int = 0         # ssm.group_count
    rope_sections: tuple = ()    # IMRoPE sections (qwen35moe)
    family_params: object = None # what a family reads beyond these fields (engine/arch/qwen4exp.py: Qwen4ExpParams)

    @property
    def norm_topk_prob(self) -> bool:   # the Hugging Face name for the same switch
        return self.expert_weights_norm

    @property
    def is_hybrid(self) -> bool:
        return bool(self.recurrent_layers)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0


@dataclass
class TensorInfo:
    name: str
    qtype: QT
    shape: tuple[int, ...]   # numpy order: rows first; the last axis is the contiguous one
    data: np.ndarray         # uint8 memmap of the raw bytes, shape (*shape[:-1], bytes per row)
    path: Path               # the file that holds it (a split set has several)
    offset: int              # absolute byte offset of the data in that file
    fused_from: str = ""     # set on a view into a fused tensor (attn_qkv, ffn_gate_up_exps): rows are not one
                             # contiguous range at `offset`; read them through `data`

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


# --- header -----------------------------------------------------------------------------------------------------

_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                 12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass
class RawTensor:
    name: str
    dims: tuple[int, ...]    # ggml order (ne0 first)
    type_id: int
    offset: int              # relative to the data section


@dataclass
class GGUFHeader:
    metadata: dict                          # every key-value pair, arrays as lists
    types: dict[str, list[GGUFValueType]]   # key -> [type] or [ARRAY, element type], as GGUFWriter takes them
    tensors: list[RawTensor]                # empty in a vocabulary-only GGUF
    data_offset: int
    file_size: int


def read_header(path) -> GGUFHeader:
    """Read a GGUF header without trusting it: metadata, value types and tensor infos, or a one-line ModelError.

    The one reader of GGUF headers here (the model, the tokenizer and tools.make_moe use it). Not gguf.GGUFReader:
    that builds one NumPy array per vocabulary string (17-20 s for the 150k-token Qwen2 vocabulary) and crashes on
    a truncated file; this one is bounds-checked and takes a fraction of a second.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(4)
            if head != GGUF_MAGIC:
                shown = head.decode("latin-1").encode("unicode_escape").decode() or "an empty file"
                raise ModelError(f"{path} is not a GGUF file (it starts with {shown!r}, not 'GGUF'); "
                                 f"give the path of a .gguf file")
            if size < 24:
                raise ModelError(f"{path} is truncated ({size} bytes, shorter than a GGUF header); download it again")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return _walk(buf, path, size)
    except (struct.error, IndexError, ValueError):   # a read past the end, or bytes that are no UTF-8 string
        raise ModelError(f"{path} is truncated or damaged inside its header ({size:,} bytes); "
                         f"download it again") from None
    finally:
        buf.close()


def _walk(buf, path: Path, size: int) -> GGUFHeader:
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ModelError(f"{path} is GGUF version {version}; only versions 2 and 3 are read")
    pos = 24

    def read_str(p):
        (n,) = _U64.unpack_from(buf, p)
        if p + 8 + n > size:
            raise struct.error("string past the end")
        return buf[p + 8:p + 8 + n].decode("utf-8", errors="surrogateescape"), p + 8 + n

    def check_type(vtype):
        if vtype not in _SCALAR_FMT and vtype not in (_STRING, _ARRAY):
            raise ModelError(f"{path} has a metadata value of unknown type {vtype}; the file is damaged")

    def read_value(p, vtype):
        if vtype in _SCALAR_FMT:
            fmt = _SCALAR_FMT[vtype]
            return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)
        if vtype == _STRING:
            return read_str(p)
        etype, count = struct.unpack_from("<IQ", buf, p)
        check_type(etype)
        p += 12
        if etype in _SCALAR_DTYPE:
            dt = np.dtype(_SCALAR_DTYPE[etype])
            end = p + count * dt.itemsize
            if end > size:
                raise struct.error("array past the end")
            return np.frombuffer(buf, dtype=dt, count=count, offset=p).tolist(), end
        if count * 8 > size - p:   # every element takes at least 8 bytes
            raise struct.error("array longer than the file")
        if etype == _STRING:   # vocabularies and merges: the hot loop, kept tight
            out, unpack = [], _U64.unpack_from
            for _ in range(count):
                (n,) = unpack(buf, p)
                q = p + 8 + n
                if q > size:
                    raise struct.error("string past the end")
                out.append(buf[p + 8:q].decode("utf-8", errors="surrogateescape"))
                p = q
            return out, p
        out = []
        for _ in range(count):
            v, p = read_value(p, etype)
            out.append(v)
        return out, p

    metadata, types = {}, {}
    for _ in range(n_kv):
        key, pos = read_str(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        check_type(vtype)
        types[key] = [GGUFValueType(vtype)]
        if vtype == _ARRAY:
            (etype,) = struct.unpack_from("<I", buf, pos + 4)
            check_type(etype)
            types[key].append(GGUFValueType(etype))
        metadata[key], pos = read_value(pos + 4, vtype)

    tensors = []
    for _ in range(n_tensors):
        name, pos = read_str(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        if n_dims > 8:
            raise ModelError(f"{path}: tensor {name} claims {n_dims} dimensions; the file is damaged")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append(RawTensor(name, tuple(int(d) for d in dims), int(type_id), int(offset)))
    if pos > size:
        raise struct.error("tensor infos past the end")
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelError(f"{path} declares general.alignment={alignment}, not a power of two; the file is damaged")
    data_offset = (pos + alignment - 1) // alignment * alignment
    return GGUFHeader(metadata, types, tensors, data_offset, size)


def _check_tensor(path: Path, t: RawTensor, data_offset: int, size: int) -> None:
    try:
        qt = QT(t.type_id)
    except ValueError:
        raise ModelError(f"{path}: tensor {t.name} has quant type id {t.type_id}, which this engine does not know; "
                         f"use a GGUF quantized to one of {_qtype_list()}") from None
    if qt not in SUPPORTED_QTYPES:
        raise ModelError(f"{path}: tensor {t.name} is {qt.name}, a quant type this engine does not support; "
                         f"use a GGUF quantized to one of {_qtype_list()}")
    block, type_size = GGML_QUANT_SIZES[qt]
    if not t.dims or t.dims[0] % block:
        raise ModelError(f"{path}: tensor {t.name} has rows of {t.dims[0] if t.dims else 0} values, "
                         f"not a whole number of {qt.name} blocks of {block}; the file is damaged")
    nbytes = t.dims[0] // block * type_size * int(np.prod(t.dims[1:], dtype=np.int64))
    end = data_offset + t.offset + nbytes
    if end > size:
        raise ModelError(f"{path} is truncated: tensor {t.name} ends at byte {end:,} but the file has "
                         f"{size:,} bytes; download it again")


def _qtype_list() -> str:
    return ", ".join(q.name for q in sorted(SUPPORTED_QTYPES, key=lambda q: q.value))


# --- the model --------------------------------------------------------------------------------------------------

def split_paths(path: Path) -> list[Path]:
    """All files of a split set given its first (or any) file; [path] for a single file."""
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelError(f"{path.name} is part {m['no']} of a {count}-file split set but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}; download every part")
    return paths


def open_model(path) -> "GGUFModel":
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no model file at {path}; check the path given to --model")
    return GGUFModel(path)


class GGUFModel:
    def __init__(self, path: Path):
        self.path = path
        self.paths = split_paths(path)
        self.metadata: dict = {}
        self._tensors: dict[str, TensorInfo] = {}
        self._maps: list[np.memmap] = []
        for i, p in enumerate(self.paths):
            header = read_header(p)
            raw, data_offset = header.tensors, header.data_offset
            for t in raw:
                _check_tensor(p, t, data_offset, header.file_size)
            if i == 0:
                self.metadata = header.metadata
            mm = np.memmap(p, dtype=np.uint8, mode="r")
            self._maps.append(mm)
            for t in raw:
                if t.name in self._tensors:
                    raise ModelError(f"{p}: tensor {t.name} appears twice in the model; the file is damaged")
                qt = QT(t.type_id)
                block, type_size = GGML_QUANT_SIZES[qt]
                shape = tuple(reversed(t.dims))
                start = data_offset + t.offset
                row_bytes = shape[-1] // block * type_size
                nbytes = row_bytes * int(np.prod(shape[:-1], dtype=np.int64))
                data = mm[start:start + nbytes].reshape(*shape[:-1], row_bytes)
                self._tensors[t.name] = TensorInfo(t.name, qt, shape, data, p, start)
        if not self._tensors:
            raise ModelError(f"{path.name} holds no tensors (a vocabulary-only GGUF?); point --model at a model")
        _as_llama_cpp_loads(self)
        n_split = int(self.metadata.get("split.count", 1) or 1)
        if n_split != len(self.paths):
            raise ModelError(f"{path.name} says the model is split into {n_split} files but its name does not "
                             f"follow -00001-of-{n_split:05d}.gguf; rename the parts as llama.cpp names them")
        self.config = read_config(self.metadata, self)
        _check_required(self)

    # --- tensors ---
    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> TensorInfo:
        t = self._tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path.name} has no tensor {name}, which a {self.metadata.get('general.architecture')} "
                             f"model needs; the file is incomplete or was made for another program")
        return t

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def dequant(self, name: str) -> np.ndarray:
        t = self.tensor(name)
        return dequantize(t.data, t.qtype)

    def expert_name(self, layer: int, kind: str) -> str:
        if kind not in EXPERT_KINDS:
            raise ValueError(f"expert kind {kind!r}: one of {EXPERT_KINDS}")
        return f"blk.{layer}.ffn_{kind}_exps.weight"

    def expert_bytes(self, layer: int, kind: str, e: int) -> np.ndarray:
        """Raw bytes of expert e's gate/up/down matrix in one layer: uint8 (rows, bytes per row), memory-mapped."""
        t = self.tensor(self.expert_name(layer, kind))
        if not 0 <= e < t.shape[0]:
            raise IndexError(f"expert {e} of {t.shape[0]} in {t.name}")
        return t.data[e]

    def dequant_expert(self, layer: int, kind: str, e: int) -> np.ndarray:
        t = self.tensor(self.expert_name(layer, kind))
        return dequantize(self.expert_bytes(layer, kind, e), t.qtype)

    def close(self) -> None:
        # The memmaps close when the last view of them goes; dropping ours is all that is safe to do here.
        self._tensors.clear()
        self._maps.clear()


# Tensors whose llama.cpp shape has fewer dimensions than Hugging Face's: llama.cpp drops trailing unit dimensions
# (ggml_n_dims), so llama-quantize'd files store qwen2moe's shared-expert gate [1, n_embd] as 1-D [n_embd]. Both
# load here as the row matrix the HF shape is.
_ROW_MATRICES = ("ffn_gate_inp_shexp.weight",)
# Where llama.cpp's attn_qkv is the attention's q, k and v stacked (its create_tensor_qkv); the hybrid
# architectures' attn_qkv (linear-attention mixing) means something else.
_QKV_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")


def _view(t: TensorInfo, name: str, shape: tuple[int, ...], data: np.ndarray, first_byte: int) -> TensorInfo:
    return TensorInfo(name, t.qtype, shape, data, t.path, t.offset + first_byte, fused_from=t.name)


def _as_llama_cpp_loads(model: "GGUFModel") -> None:
    """Present the tensors as llama.cpp's loader takes them: row matrices 2-D, and fused attn_qkv (q, k, v rows
    stacked, create_tensor_qkv) and ffn_gate_up_exps (per expert the gate rows, then the up rows,
    create_tensor_gate_up_exps) as their separate parts, views of the same bytes (quant blocks never cross a
    row, so a row range of a quantized matrix is itself a valid matrix)."""
    ts, md = model._tensors, model.metadata
    for name, t in list(ts.items()):
        if name.endswith(_ROW_MATRICES) and len(t.shape) == 1:
            ts[name] = TensorInfo(name, t.qtype, (1, t.shape[0]), t.data.reshape(1, -1), t.path, t.offset)
    arch = md.get("general.architecture")
    fused_qkv = [n for n in ts if n.endswith(("attn_qkv.weight", "attn_qkv.bias"))] if arch in _QKV_ARCHS else []
    for name in fused_qkv:
        t = ts.pop(name)
        n_embd, n_head = md.get(f"{arch}.embedding_length"), md.get(f"{arch}.attention.head_count")
        if not isinstance(n_embd, int) or not isinstance(n_head, int) or n_head <= 0:
            raise ModelError(f"{model.path.name} has fused {name} but no head counts to split it by; damaged?")
        n_kv = md.get(f"{arch}.attention.head_count_kv", n_head)
        dk = md.get(f"{arch}.attention.key_length", n_embd // n_head)
        dv = md.get(f"{arch}.attention.value_length", dk)
        widths = (n_head * dk, n_kv * dk, n_kv * dv)
        rows = t.shape[0]
        if rows != sum(widths):
            raise ModelError(f"{model.path.name}: {name} has {rows} rows, not q+k+v = {'+'.join(map(str, widths))}"
                             f"; the file is damaged or its head counts are wrong")
        start = 0
        stem, suffix = name.rsplit("qkv.", 1)     # "blk.3.attn_", "weight" or "bias"
        for part, width in zip("qkv", widths):
            if len(t.shape) == 1:   # a bias: float elements
                size = GGML_QUANT_SIZES[t.qtype][1]
                data = t.data[start * size:(start + width) * size]
                ts[f"{stem}{part}.{suffix}"] = _view(t, f"{stem}{part}.{suffix}", (width,), data, start * size)
            else:
                data = t.data[start:start + width]
                ts[f"{stem}{part}.{suffix}"] = _view(t, f"{stem}{part}.{suffix}", (width, t.shape[1]), data,
                                                     start * t.data.shape[1])
            start += width
    for name in [n for n in ts if n.endswith("ffn_gate_up_exps.weight")]:
        t = ts.pop(name)
        if len(t.shape) != 3 or t.shape[1] % 2:
            raise ModelError(f"{model.path.name}: {name} has shape {t.shape}, not (experts, 2 x width, n_embd); "
                             f"the file is damaged")
        half = t.shape[1] // 2
        stem = name[:-len("gate_up_exps.weight")]
        for part, lo in (("gate", 0), ("up", half)):
            ts[f"{stem}{part}_exps.weight"] = _view(t, f"{stem}{part}_exps.weight", (t.shape[0], half, t.shape[2]),
                                                    t.data[:, lo:lo + half], lo * t.data.shape[2])


def dequantize(data: np.ndarray, qtype: QT) -> np.ndarray:
    """Raw GGUF bytes (..., bytes per row) -> float32 (..., values per row), through gguf's reference code."""
    if qtype == QT.F32:
        return np.ascontiguousarray(data).view(np.float32).copy()
    return np.asarray(gguf.quants.dequantize(np.ascontiguousarray(data), qtype), dtype=np.float32)


# --- hyperparameters ---------------------------------------------------------------------------------------------

def read_config(md: dict, model: GGUFModel) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch is None:
        raise ModelError(f"{model.path.name} has no general.architecture; it is not a model GGUF (a vocabulary only?)")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"{model.path.name} is architecture {arch!r}, which this engine does not run yet; "
                         f"supported: {', '.join(SUPPORTED_ARCHS)} (llama with experts = mixtral-style)")

    def get(key, default=None, required=False):
        v = md.get(f"{arch}.{key}")
        if v is None:
            if required:
                raise ModelError(f"{model.path.name} lacks the metadata key {arch}.{key}; the file is incomplete")
            return default
        if isinstance(v, list):   # per-layer arrays (some converters): every layer the same here
            if len(set(v)) != 1:
                raise ModelError(f"{model.path.name}: {arch}.{key} differs per layer ({v[:4]}...), "
                                 f"which this engine does not support")
            v = v[0]
        return v

    for key in ("block_count", "embedding_length", "attention.head_count"):
        v = get(key, required=True)
        if not isinstance(v, int) or v <= 0:
            raise ModelError(f"{model.path.name}: {arch}.{key}={v!r} is not a positive count; the file is damaged")
    n_embd = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_head_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", n_embd // n_head))
    head_dim_v = int(get("attention.value_length", head_dim))
    emb = model.tensor("token_embd.weight")
    n_vocab = emb.shape[0]
    n_expert = int(get("expert_count", 0) or 0)

    scaling = str(get("rope.scaling.type", "none") or "none")
    factor = float(get("rope.scaling.factor", 0.0) or 0.0)
    if scaling == "none" and get("rope.scale_linear") is not None:   # older GGUFs
        scaling, factor = "linear", float(get("rope.scale_linear"))
    if scaling not in ("none", "linear", "yarn"):
        raise ModelError(f"{model.path.name} declares RoPE scaling {scaling!r}; this engine applies none, linear "
                         f"and yarn only")
    freq_scale = 1.0 / factor if scaling != "none" and factor > 0 else 1.0
    n_ctx_train = int(get("context_length", 4096))

    cfg = ModelConfig(
        arch=arch, n_layer=int(get("block_count", required=True)), n_embd=n_embd, n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, head_dim_v=head_dim_v,
        n_ff=int(get("feed_forward_length", 0) or 0), n_vocab=n_vocab, n_ctx_train=n_ctx_train,
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_type="norm" if arch == "llama" else "neox",
        n_rot=int(get("rope.dimension_count", head_dim)),
        rope_scaling=scaling, rope_freq_scale=freq_scale,
        rope_n_ctx_orig=int(get("rope.scaling.original_context_length", n_ctx_train)),
        yarn_ext_factor=float(get("rope.scaling.yarn_ext_factor", 1.0)) if scaling == "yarn" else 0.0,
        yarn_attn_factor=float(get("rope.scaling.yarn_attn_factor", get("rope.scaling.attn_factor", 1.0)) or 1.0),
        yarn_beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0) or 32.0),
        yarn_beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0) or 1.0),
        attn_scale=float(get("attention.scale", 0.0) or 0.0),
        n_expert=n_expert, n_expert_used=int(get("expert_used_count", 0) or 0),
        n_ff_exp=int(get("expert_feed_forward_length", 0) or 0),
        n_ff_shexp=int(get("expert_shared_feed_forward_length", 0) or 0),
        expert_weights_scale=float(get("expert_weights_scale", 0.0) or 0.0) or 1.0,
        tied_embeddings=not model.has("output.weight"),
    )
    if arch in ("qwen2moe", "qwen3moe") and not n_expert:
        raise ModelError(f"{model.path.name} is {arch} but has no {arch}.expert_count; the file is incomplete")
    if n_expert:
        if not 0 < cfg.n_expert_used <= n_expert:
            raise ModelError(f"{model.path.name}: {arch}.expert_used_count={cfg.n_expert_used} with "
                             f"{n_expert} experts; the file is damaged")
        gate = model.tensor("blk.0.ffn_gate_exps.weight")
        if not cfg.n_ff_exp:
            cfg.n_ff_exp = gate.shape[1]
    # What llama.cpp does per architecture (the arguments of its build_moe_ffn calls), whatever the file says:
    # qwen3moe and llama-MoE renormalize the top-k softmax weights; qwen2moe keeps them raw and adds a
    # sigmoid-gated shared expert.
    cfg.expert_weights_norm = arch in ("qwen3moe", "llama", "qwen3next", "qwen35moe")
    if arch in HYBRID_ARCHS:
        from engine.arch.qwen3next import read_hybrid_config
        read_hybrid_config(cfg, get, model)
    cfg.qk_norm = model.has(f"blk.{cfg.recurrent_layers.index(False) if cfg.is_hybrid else 0}.attn_q_norm.weight")
    cfg.attn_bias = model.has("blk.0.attn_q.bias")
    cfg.shared_expert = model.has("blk.0.ffn_up_shexp.weight")
    cfg.shared_expert_gate = model.has("blk.0.ffn_gate_inp_shexp.weight")
    if cfg.shared_expert and not cfg.n_ff_shexp:
        cfg.n_ff_shexp = model.tensor("blk.0.ffn_up_shexp.weight").shape[0]
    if arch == "gpt-oss":
        from engine.arch.gptoss import read_gptoss_config
        read_gptoss_config(cfg, md, model)
    import engine.arch                   # the families that declare their own config rules (qwen4exp)
    engine.arch.read_family_config(cfg, md, model)
    if n_head_kv <= 0 or head_dim <= 0 or n_head % n_head_kv:
        raise ModelError(f"{model.path.name}: {n_head} heads do not share {n_head_kv} KV heads evenly; damaged?")
    if emb.shape[-1] != n_embd:
        raise ModelError(f"{model.path.name}: token_embd.weight is {emb.shape[-1]} wide but {arch}.embedding_length is "
                         f"{n_embd}; the file is damaged")
    if cfg.n_rot > head_dim or cfg.n_rot % 2:
        raise ModelError(f"{model.path.name}: rope.dimension_count={cfg.n_rot} does not fit heads of {head_dim}")
    return cfg


def _ffn_norm(cfg: ModelConfig) -> str:
    return "post_attention_norm.weight" if cfg.arch == "gpt-oss" else "ffn_norm.weight"   # llama.cpp's names


def required_tensors(cfg: ModelConfig, model: GGUFModel) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        names += [b + n for n in ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                  "attn_output.weight", _ffn_norm(cfg))]
        if cfg.qk_norm:
            names += [b + "attn_q_norm.weight", b + "attn_k_norm.weight"]
        if cfg.attn_bias:
            names += [b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"]
        if cfg.is_moe:
            names += [b + "ffn_gate_inp.weight"] + [b + f"ffn_{k}_exps.weight" for k in EXPERT_KINDS]
            if cfg.shared_expert:
                names += [b + f"ffn_{k}_shexp.weight" for k in EXPERT_KINDS]
            if cfg.shared_expert_gate:
                names += [b + "ffn_gate_inp_shexp.weight"]
        else:
            names += [b + f"ffn_{k}.weight" for k in EXPERT_KINDS]
    return names


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Numpy shapes of the main per-layer tensors (layer 0's names; every layer is the same)."""
    E, q, kv, v = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_head_kv * cfg.head_dim_v
    shapes = {"attn_q.weight": (q, E), "attn_k.weight": (kv, E), "attn_v.weight": (v, E),
              "attn_output.weight": (E, cfg.n_head * cfg.head_dim_v), "attn_norm.weight": (E,), _ffn_norm(cfg): (E,)}
    if cfg.is_moe:
        X, F = cfg.n_expert, cfg.n_ff_exp
        shapes.update({"ffn_gate_inp.weight": (X, E), "ffn_gate_exps.weight": (X, F, E),
                       "ffn_up_exps.weight": (X, F, E), "ffn_down_exps.weight": (X, E, F)})
    else:
        shapes.update({"ffn_gate.weight": (cfg.n_ff, E), "ffn_up.weight": (cfg.n_ff, E),
                       "ffn_down.weight": (E, cfg.n_ff)})
    return shapes


def _check_required(model: GGUFModel) -> None:
    cfg = model.config
    import engine.arch
    if engine.arch.check_family_tensors(model):
        return
    if cfg.is_hybrid:
        from engine.arch.qwen3next import check_tensors
        check_tensors(model)
        return
    for name in required_tensors(cfg, model):
        model.tensor(name)
    shapes = expected_shapes(cfg)
    for i in range(cfg.n_layer):
        for suffix, want in shapes.items():
            t = model.tensor(f"blk.{i}.{suffix}")
            if t.shape != want:
                raise ModelError(f"{model.path.name}: tensor {t.name} has shape {t.shape}, but the metadata implies "
                                 f"{want}; the file is damaged or made for another program")
    out = model.tensor("token_embd.weight" if cfg.tied_embeddings else "output.weight")
    if out.shape != (cfg.n_vocab, cfg.n_embd):
        raise ModelError(f"{model.path.name}: tensor {out.name} has shape {out.shape}, expected "
                         f"{(cfg.n_vocab, cfg.n_embd)}; the file is damaged")
