"""What the kernel benches (bench.moe_gemm, bench.prefill_attn) share: the tensor cores' ceiling they print beside
their figures, and the A/B options that load another build of the kernel's file (--module: a copy of an earlier
version under cuda_src/; --define: a variant's compile-time defines)."""
from __future__ import annotations

CUBLAS_TFLOPS = 749.0      # docs/design.md "Measured facts": cuBLAS's fp16 GEMM at 8192^3 on the H200


def add_args(ap, module: str, example: str) -> None:
    ap.add_argument("--module", default=module,
                    help="the cuda_src file (stem) to load, for an A/B against a copy of an earlier version")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help=f"a {module}.cu define for a variant (e.g. {example}); repeatable")


def defines(ap, a) -> dict[str, str]:
    """The --define options as a dict; a malformed one is refused through the parser (exit 2, with the usage)."""
    bad = [d for d in a.define if "=" not in d]
    if bad:
        ap.error(f"--define takes NAME=VALUE, got {bad[0]!r}")
    return dict(d.split("=", 1) for d in a.define)
