"""A model's hyperparameters (ModelConfig) and the error every part raises for a model it cannot use (ModelError).

engine/gguf_model.read_config fills a ModelConfig from the keys every architecture shares, then the model's family
(engine/arch/) applies its own rules. Both import this module, which imports nothing of the project's, so that the
file reader and the families never import each other's modules in a circle.
"""
from __future__ import annotations

from dataclasses import dataclass


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
    # Per layer: does it route to experts (else a dense FFN). read_config fills it: every layer when the model has
    # experts, unless the family sets a plan of its own (leading dense layers, as GLM's and DeepSeek's files have).
    moe_layers: tuple[bool, ...] = ()
    # What only one family reads: a dataclass its engine/arch/ module defines and its rules fill, or None.
    family_params: object = None

    @property
    def norm_topk_prob(self) -> bool:   # the Hugging Face name for the same switch
        return self.expert_weights_norm

    @property
    def is_hybrid(self) -> bool:
        return bool(self.recurrent_layers)

    @property
    def is_moe(self) -> bool:
        """The model has routed experts (in at least one layer: is_moe_layer says which)."""
        return self.n_expert > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layers[layer]

