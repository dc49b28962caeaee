"""tools/ptx_compare.py's split of a PTX module into functions and its comparison (the nvcc runs are not tested here:
tests/test_cuda_compile.py compiles the same builds)."""
from tools.ptx_compare import compare, functions

PTX = """.version 8.8
.target sm_90
.global .align 1 .b8 table[2] = {1, 2};

.func  (.param .b32 func_retval0) _Z3addILi12EEjj(
\t.param .b32 a
)
{
\tret;
}
.visible .entry _Z2mvILi39EEvPKh(
\t.param .u64 p
)
{
\tld.global.nc.u8 %r1, [%rd1];
\tret;
}
.visible .entry matvec_r1_nv1(
\t.param .u64 p
)
{
\tret;
}
"""


def test_functions_splits_at_each_entry_and_func():
    f = functions(PTX)
    assert list(f) == ["<header>", "_Z3addILi12EEjj", "_Z2mvILi39EEvPKh", "matvec_r1_nv1"]
    assert "table[2]" in f["<header>"] and "ld.global.nc.u8" in f["_Z2mvILi39EEvPKh"]
    assert "".join(f.values()) == PTX


def test_compare_names_changed_added_and_removed_functions():
    a = functions(PTX)
    b = functions(PTX.replace("ld.global.nc.u8", "ld.global.nc.u32").replace("matvec_r1_nv1", "matvec_r2_nv1"))
    same, diff = compare(a, b)
    assert same == ["<header>", "_Z3addILi12EEjj"]
    assert diff == ["_Z2mvILi39EEvPKh", "matvec_r1_nv1", "matvec_r2_nv1"]
    assert compare(a, a) == (sorted(a), [])
