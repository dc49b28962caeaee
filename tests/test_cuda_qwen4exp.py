"""qwen4exp on the CUDA backend (engine/cuda/families/qwen4exp.py) against the NumPy backend (DESIGN section 7), on
tests/fixtures/qwen4exp's tiny files (F16, IQ2_XS; Q2_0 once engine/cuda/quant_types.py validates it) with their
reference prompts: 8 tokens (dense), 16 (at the QSA budget), 40 (the prompt crosses it), 24 with EOS inside (the
n-gram reset). Teacher-forced logits within 1e-2 relative (2e-2 for the prompt pass, as the hybrids': the recurrent
state carries the chunk GEMMs' fp16 roundings) across prompt chunks of 8 and then through the decode graph, greedy
tokens equal with the expert cache holding all, some and none of the experts, a resume from a checkpoint equal to a
cold run, the n-gram row counts as the CPU backend's. The worker-protocol suite's qwen4exp cases run on CUDA too:
STRATA_TEST_BACKEND=cuda pytest tests/test_worker_protocol.py -k qwen4exp."""
import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.gguf_model import open_model  # noqa: E402
from gpu_compare import assert_same_greedy, greedy, rel_rows  # noqa: E402
from route_ties import Reference, RouteRecorder, greedy_reference, gpu_routes  # noqa: E402

HERE = Path(__file__).resolve().parent / "fixtures" / "qwen4exp"
CTX = 256
CHUNK = 8           # the 40-token prompt crosses five chunks and the QSA budget (16 tokens) inside the pass
N_GREEDY = 12
FILES = ("f16", "iq2_xs", "q2_0")
CASES = ("short", "at_budget", "long", "ple_eos")
REL, REL_PROMPT = 1e-2, 2e-2
SAME = 1e-5


def model_of(recipe: str):
    model = open_model(HERE / f"tiny-qwen4exp-{recipe}.gguf")
    return model


def prompts(recipe: str) -> dict:
    ref = json.loads((HERE / f"tiny-qwen4exp-{recipe}.json").read_text())
    return {c["name"]: list(c["prompt_ids"]) for c in ref["cases"]}


def cuda_backend(model, **opts):
    from engine.cuda.backend import CUDABackend, CudaOptions
    kw = dict(prefill_chunk=CHUNK, adapt_every=0)
    kw.update(opts)
    # Q2_0 runs here on kernels engine/cuda/quant_types.py NOT_VALIDATED still keeps from the worker: these tests
    # are that validation
    return CUDABackend(model, CTX, CudaOptions(**kw), tracer=RouteRecorder())


def routed_reference(be, model, run):
    be.tracer.routes = []
    got = run()
    ref = Reference(model, CTX, gpu_routes(be.tracer.routes))
    be.tracer.routes = None
    return got, ref


def assert_routed_greedy(be, model, got_fn, prompt, n):
    got, ref = routed_reference(be, model, got_fn)
    try:
        want, step_logits = greedy_reference(ref, prompt, n)
    finally:
        ref.close()
    assert ref.clear_parts() == [], f"routes taken against a clear gap (position, layer, gap, cpu, cuda): {ref.parted}"
    assert_same_greedy(got, want, step_logits)


def assert_teacher_forced(be, model, seq):
    """The CUDA backend's logits of every position of seq (one forward, the prompt pass's chunks) within REL_PROMPT
    of the routed reference's; returns the reference's logits."""
    lg, ref = routed_reference(be, model, lambda: be.forward(seq, all_logits=True))
    try:
        want = ref.forward(seq, all_logits=True)
    finally:
        ref.close()
    assert ref.clear_parts() == [], ref.parted
    assert np.isfinite(lg).all()
    assert rel_rows(lg, want).max() < REL_PROMPT
    return want


def cpu_continuation(model, prompt, n):
    """The NumPy backend's greedy tokens after prompt and the logits of prompt + those tokens' rows."""
    from engine.backend_cpu import CPUBackend
    cpu = CPUBackend(model, CTX)
    try:
        lg = [cpu.forward(prompt, all_logits=True)]
        toks = []
        for _ in range(n):
            toks.append(int(np.argmax(lg[-1][-1])))
            lg.append(cpu.forward([toks[-1]], all_logits=True))
    finally:
        cpu.close()
    return toks, np.concatenate(lg[:-1], axis=0)


def test_the_backend_takes_qwen4exp():
    model = model_of("iq2_xs")
    be = cuda_backend(model)
    try:
        assert be.recurrent and be.family.name == "qwen4exp" and be.prompt_chunk_size() == CHUNK
        assert be.state_bytes() > 0 and "ple_row_cache_mib" in be.info()
    finally:
        be.close()


def test_int8_kv_is_refused_by_name():
    from engine.cuda.backend import CUDABackend, CudaOptions
    with pytest.raises(ValueError, match="--kv f16"):
        CUDABackend(model_of("iq2_xs"), CTX, CudaOptions(kv="int8"))


@pytest.mark.parametrize("recipe", FILES)
@pytest.mark.parametrize("case", CASES)
def test_teacher_forced_logits_match_cpu(recipe, case):
    model = model_of(recipe)
    prompt = prompts(recipe)[case]
    toks, cpu_logits = cpu_continuation(model, prompt, N_GREEDY)
    be = cuda_backend(model)
    try:
        want = assert_teacher_forced(be, model, prompt + toks[:-1])
        # the prompt again from a cold state, then its continuation one token at a time through the decode graph
        # (which crosses the QSA budget on at_budget): each row within reach of one valid routing
        be.truncate(0)
        be.forward(prompt)
        dec = np.stack([be.forward([t]) for t in toks[:-1]])
        n = len(prompt)
        assert np.isfinite(dec).all()
        assert np.minimum(rel_rows(dec, cpu_logits[n:]), rel_rows(dec, want[n:])).max() < REL
    finally:
        be.close()


@pytest.mark.parametrize("recipe", ("iq2_xs", "f16"))
@pytest.mark.parametrize("share", ["none", "half", "all"])
def test_greedy_whatever_part_of_the_experts_sits_in_vram(recipe, share):
    model = model_of(recipe)
    prompt = prompts(recipe)["long"]
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    slots = {"none": 0, "half": total // 2, "all": total}[share]
    be = cuda_backend(model, expert_slots=slots, adapt_every=4, stream_min=1)
    try:
        assert be.cache.n_slots == slots
        assert_routed_greedy(be, model, lambda: greedy(be, prompt, N_GREEDY), prompt, N_GREEDY)
        st = be.get_stats()
        assert st.lookups == (N_GREEDY - 1) * cfg.n_layer * cfg.n_expert_used
        if share == "none":
            assert st.hits == 0
        if share == "all":
            assert st.hits == st.lookups
    finally:
        be.close()


@pytest.mark.parametrize("recipe", ("iq2_xs", "f16"))
def test_snapshot_decode_restore_decode_equals_and_a_resume_is_a_cold_run(recipe):
    model = model_of(recipe)
    prompt = prompts(recipe)["long"]
    be = cuda_backend(model)
    try:
        head = 18           # past the budget, mid-block and mid-chunk: the pooled keys and the PLE context carry
        be.tracer.routes = []
        be.forward(prompt[:head])
        snap = be.snapshot_state()
        assert snap.n_tokens == head and snap.nbytes == be.state_bytes() > 0
        first = np.stack([be.forward([t]) for t in prompt[head:head + 8]])
        be.forward([5, 6, 7])
        be.restore_state(snap)
        assert be.n_cached == head
        again = np.stack([be.forward([t]) for t in prompt[head:head + 8]])
        assert rel_rows(again, first).max() < SAME
        be.restore_state(snap)
        routes = be.tracer.routes

        def resumed():
            be.tracer.routes = routes
            be.forward(prompt[head:-1])
            return greedy(be, prompt[-1:], N_GREEDY)
        assert_routed_greedy(be, model, resumed, prompt, N_GREEDY)
    finally:
        be.close()


def test_truncate_only_to_zero_or_the_end():
    model = model_of("iq2_xs")
    prompt = prompts("iq2_xs")["long"]
    be = cuda_backend(model)
    try:
        first = be.forward(prompt[:30])
        with pytest.raises(ValueError, match="cannot be rewound"):
            be.truncate(20)
        be.truncate(0)      # a cold start: the state and the PLE context are reset
        assert rel_rows(be.forward(prompt[:30])[None], first[None]).max() < 1e-3
    finally:
        be.close()


def test_ple_row_counts_are_the_cpu_backends():
    from engine.backend_cpu import CPUBackend
    model = model_of("iq2_xs")
    prompt = prompts("iq2_xs")["ple_eos"]
    counts = []
    for make in (lambda: CPUBackend(model, CTX), lambda: cuda_backend(model)):
        be = make()
        try:
            be.reset_stats()
            be.forward(prompt)
            for t in (5, 6, 7):
                be.forward([t])
            counts.append(be.request_info())
        finally:
            be.close()
    assert counts[0] == counts[1] and counts[0]["ple_row_lookups"] == 16 * (len(prompt) + 3)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """make_moe's tiny-qwen4exp: GDN heads of 128 (the fixtures' are 16), so the GDN layers run on gdn.cu's sigmoid
    build as the published models' do (engine/cuda/families/q4ops.py Gdn)."""
    from tools import make_moe
    path = tmp_path_factory.mktemp("q4wide") / "tiny-qwen4exp-128.gguf"
    make_moe.main(["--preset", "tiny-qwen4exp", "--out", str(path)])
    model = open_model(path)
    assert model.config.ssm_state == 128
    return model


@pytest.mark.parametrize("share", ["none", "all"])
def test_gdn_cu_layers_match_cpu(wide_model, share):
    """Teacher-forced logits of a 40-token prompt in chunks of 8 (the chunked delta rule carried across them) and
    the greedy continuation through the decode graph (mv_many's conv epilogue, gdn_delta_decode) against the NumPy
    backend, the expert cache holding none or all of the experts."""
    model = wide_model
    cfg = model.config
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, cfg.n_vocab, 40)]
    toks, cpu_logits = cpu_continuation(model, prompt, N_GREEDY)
    slots = {"none": 0, "all": cfg.n_layer * cfg.n_expert}[share]
    be = cuda_backend(model, expert_slots=slots, stream_min=1)
    try:
        assert be.step.layers.gdn.gk is not None          # both programs' GDN layers on gdn.cu
        assert be.prefill.layers.gdn.prompt_scratch.max_tokens >= CHUNK
        assert_teacher_forced(be, model, prompt + toks[:-1])
        be.truncate(0)
        assert_routed_greedy(be, model, lambda: greedy(be, prompt, N_GREEDY), prompt, N_GREEDY)
    finally:
        be.close()
