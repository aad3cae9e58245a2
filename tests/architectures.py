"""Tiny random configs of the verifier families beyond Llama / Qwen, built in-process (no hub).

Each one exercises what sets its family apart: Gemma 2 (√H embedding scale, attention and final soft-capping,
alternating sliding layers), Gemma 3 (q/k norms, per-layer-type RoPE, sliding and full layers, final soft-cap),
Phi-3 (fused qkv / gate-up projections), Qwen3-MoE (routed experts), OLMo 2 (post-norms, q/k norm over all heads),
Granite (embedding / residual / attention multipliers, logit scaling), Mistral with a sliding window, GPT-OSS
(experts, attention sinks, alternating sliding layers), Qwen2-MoE with a sliding layer (its layers pass no window
to the attention: HF's mask alone applies it). Windows are 8 tokens, so every test's prompts pass them.
"""

from __future__ import annotations

import torch

WINDOW = 8
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=None,
              tie_word_embeddings=False)
FAMILIES: dict[str, dict] = {
    "gemma2": dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                   attn_logit_softcapping=0.5, final_logit_softcapping=4.0),
    "gemma3_text": dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        final_logit_softcapping=4.0),
    "phi3": dict(num_hidden_layers=2),
    "qwen3_moe": dict(num_hidden_layers=2, head_dim=16, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2),
    "olmo2": dict(num_hidden_layers=2),
    "granite": dict(num_hidden_layers=2, embedding_multiplier=4.0, residual_multiplier=0.5,
                    attention_multiplier=0.2, logits_scaling=2.0),
    "mistral": dict(num_hidden_layers=2, sliding_window=WINDOW),
    "qwen2_moe": dict(num_hidden_layers=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2, use_sliding_window=True, sliding_window=WINDOW,
                      layer_types=["sliding_attention", "full_attention"]),
    "gpt_oss": dict(num_hidden_layers=2, head_dim=16, intermediate_size=64, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                                     "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
}
SLIDING = ("gemma2", "gemma3_text", "mistral", "gpt_oss", "qwen2_moe")


def tiny_model(family: str, vocab_size: int = 300, seed: int = 0, logit_gain: float = 8.0):
    """A random-weight causal LM of ``family`` (fp32, eval mode), its ``lm_head`` scaled by ``logit_gain`` so that
    argmaxes are not near-ties (as ``conftest.make_verifier`` does)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=vocab_size, **{**COMMON, **FAMILIES[family]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_gain)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.requires_grad_(False)
