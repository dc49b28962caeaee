"""Which of a hybrid layer's projections share a launch (engine/cuda/launch.py shared_input_launches: dense.cu mv4,
one quant type; plan_shared_input: a single matrix of another type joins through mv_mixed.cu mv4_mixed), on the CPU,
for the layers' real type mixes: the uniform files, llama-quantize's Q4_K_M recipe (attn_qkv / attn_v in Q6_K on
some layers), Q3_K_M's, more matrices than one launch takes. The kernels: tests/test_cuda_kernels.py test_mv_many
(GPU)."""
from dataclasses import dataclass

import pytest

pytest.importorskip("cupy")

from engine.cuda.launch import MV4_MAX, mixed_pairs, plan_shared_input, shared_input_launches  # noqa: E402
from engine.cuda.quant_types import qtype  # noqa: E402


@dataclass
class M:
    """The fields of a DevMatrix the plan reads."""
    qt: int
    cols: int
    row_bytes: int
    rows: int = 64


def mat(name: str, cols: int = 2048, rows: int = 64) -> M:
    q = qtype(name)
    return M(q.id, cols, q.row_bytes(cols), rows)


def test_one_type_is_one_launch():
    Ws = [mat("Q4_K", rows=r) for r in (8192, 4096, 32, 32)]      # the 35B's qkv, z, beta, alpha
    assert shared_input_launches(Ws) == [[0, 1, 2, 3]]


def test_a_recipe_layer_with_qkv_in_q6_k_takes_a_launch_per_type():
    Ws = [mat("Q6_K"), mat("Q4_K"), mat("Q4_K"), mat("Q4_K")]
    assert shared_input_launches(Ws) == [[0], [1, 2, 3]]
    # gated attention: V alone in Q6_K, the gate with q (both from attn_q)
    assert shared_input_launches([mat("Q4_K"), mat("Q4_K"), mat("Q6_K"), mat("Q4_K")]) == [[0, 1, 3], [2]]


def test_absent_matrices_are_skipped_and_indices_kept():
    """qwen3next's ssm_ba is beta alone (alpha None)."""
    assert shared_input_launches([mat("Q5_K"), mat("Q5_K"), mat("Q5_K"), None]) == [[0, 1, 2]]
    assert shared_input_launches([mat("Q8_0"), None, mat("Q4_K"), mat("Q8_0")]) == [[0, 3], [2]]


def test_matrix_zero_leads_its_launch():
    """mv_many's conv epilogue goes to the launch whose first matrix is index 0."""
    for Ws in ([mat("Q6_K"), mat("Q4_K"), mat("Q6_K")], [mat("Q4_K")] * 6):
        plan = shared_input_launches(Ws)
        assert plan[0][0] == 0 and sum(g.count(0) for g in plan) == 1


def test_width_and_row_bytes_part_launches():
    """One launch stages one input width and strides every matrix by one row length."""
    a, b = mat("Q4_K", 2048), mat("Q4_K", 4096)
    assert shared_input_launches([a, b, a]) == [[0, 2], [1]]
    padded = M(a.qt, a.cols, a.row_bytes + 16)
    assert shared_input_launches([a, padded]) == [[0], [1]]


def test_at_most_four_a_launch_every_matrix_once():
    Ws = [mat("Q4_K")] * 9 + [mat("F16")]
    plan = shared_input_launches(Ws)
    assert plan == [[0, 1, 2, 3], [4, 5, 6, 7], [8], [9]]
    assert all(len(g) <= MV4_MAX for g in plan)
    assert sorted(i for g in plan for i in g) == list(range(10))


def test_a_single_matrix_of_another_type_joins_the_others():
    q6, q4 = mat("Q6_K"), mat("Q4_K")
    assert plan_shared_input([q6, q4, q4, q4], mixed=True) == [([0, 1, 2, 3], True)]
    assert plan_shared_input([q4, q4, q6, q4], mixed=True) == [([2, 0, 1, 3], True)]      # attn_v first
    assert plan_shared_input([q6, q4, q4, None], mixed=True) == [([0, 1, 2], True)]      # qwen3next: no alpha
    assert plan_shared_input([q6, q4], mixed=True) == [([0, 1], True)]
    # without mixed, or one type: shared_input_launches' groups
    assert plan_shared_input([q6, q4, q4, q4]) == [([0], False), ([1, 2, 3], False)]
    assert plan_shared_input([q4] * 4, mixed=True) == [([0, 1, 2, 3], False)]


def test_what_stays_apart():
    q6, q5, q4 = mat("Q6_K"), mat("Q5_K"), mat("Q4_K")
    two_two = [q6, q6, q4, q4]
    assert plan_shared_input(two_two, mixed=True) == [([0, 1], False), ([2, 3], False)]
    three = [q6, q5, q4, q4]
    assert plan_shared_input(three, mixed=True) == [([0], False), ([1], False), ([2, 3], False)]
    wide = [mat("Q6_K", 4096), q4, q4]            # another width: another staging
    assert plan_shared_input(wide, mixed=True) == [([0], False), ([1, 2], False)]
    five = [q6] + [q4] * 4
    assert plan_shared_input(five, mixed=True) == [([0], False), ([1, 2, 3, 4], False)]


def test_mixed_pairs_are_the_mixed_launches_types():
    q6, q5, q4, q3 = mat("Q6_K"), mat("Q5_K"), mat("Q4_K"), mat("Q3_K")
    layers = [(q6, q4, q4, q4), (q4, q4, q4, q4), (q4, q4, q6, q4), (q5, q3, q3, None), (q6, q6, q4, q4)]
    ids = {n: qtype(n).id for n in ("Q6_K", "Q5_K", "Q4_K", "Q3_K")}
    assert mixed_pairs(layers) == {(ids["Q6_K"], ids["Q4_K"]), (ids["Q5_K"], ids["Q3_K"])}
    assert mixed_pairs(layers, mixed=False) == set()
