"""tools/recipes.py against llama-quantize itself (its --dry-run through the anchor wheel), tensor by tensor.

Header-only sources (sparse files) give llama.cpp full-size shapes at no disk cost: the 48-layer, 128-expert
Qwen3-30B-A3B, a 512-expert qwen2moe with a shared expert, an 8-expert mixtral (llama.cpp's n_expert == 8 rules),
dense llama, and small 8-layer models with and without tied embeddings.
"""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from engine.gguf_model import read_header
from tools import llama_ref as lr
from tools import recipes

SHAPES = {
    "qwen3-30b-a3b": ["--preset", "qwen3-30b-a3b"],
    "qwen3-next-80b": ["--preset", "qwen3-next-80b"],
    "mixtral-8x-32l": ["--preset", "tiny", "--arch", "llama", "--n-layer", "32", "--n-expert", "8",
                       "--n-expert-used", "2"],
    "llama-dense-20l": ["--preset", "tiny", "--arch", "llama", "--n-layer", "20"],
    "qwen3moe-8l-tied": ["--preset", "tiny", "--n-layer", "8", "--tied"],
    **lr.FIXTURE_MODELS,
}
RECIPES = ("q4_k_m", "q5_k_m", "q3_k_m", "q2_k", "q4_k_s", "iq4_xs", "q6_k", "q8_0", "iq2_xxs", "iq3_xxs", "q2_0",
           "q1_0")


def source_tensors(path) -> tuple[dict, recipes.Hparams]:
    h = read_header(path)
    arch = h.metadata["general.architecture"]
    md = lambda k, d=0: h.metadata.get(f"{arch}.{k}", d)   # noqa: E731
    hp = recipes.Hparams(md("block_count"), md("attention.head_count"), md("attention.head_count_kv"),
                         md("expert_count"))
    return {t.name: (tuple(reversed(t.dims)), Q(t.type_id)) for t in h.tensors}, hp


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    why = lr.available()
    if why:
        pytest.skip(f"needs llama.cpp's CPU wheel: {why}")
    d = tmp_path_factory.mktemp("hdr")
    return {name: lr.header_only_source(d / f"{name}.gguf", args) for name, args in SHAPES.items()}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_recipe_types_equal_llama_quantize(sources, shape):
    tensors, hp = source_tensors(sources[shape])
    wrong = []
    for recipe in RECIPES:
        theirs = lr.planned_types(sources[shape], recipe)
        ours = {n: q.name for n, q in recipes.recipe_types(tensors, recipe, hp).items()}
        assert set(ours) == set(theirs)
        wrong += [f"{recipe} {n}: ours {ours[n]}, llama.cpp {theirs[n]}" for n in ours if ours[n] != theirs[n]]
    assert not wrong, f"{len(wrong)} tensors differ, e.g. " + "; ".join(wrong[:6])


def test_more_bits_layers():
    # Q4_K_M's ffn_down on 48 layers: the first and last 6 and every third between
    assert [i for i in range(48) if recipes.more_bits(i, 48)] == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26,
                                                                  29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]


def test_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="unknown recipe"):
        recipes.recipe_types({}, "q4_k_xl", recipes.Hparams(8, 4, 2, 4))
