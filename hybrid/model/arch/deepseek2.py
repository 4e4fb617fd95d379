"""deepseek2 (DeepSeek V2/V3/R1, Kimi K2, GLM-4.7-Flash): multi-head latent attention (mla.py), YaRN with its
magnitude in the KQ scale (gguf_io.config), leading dense layers, then MoE layers with softmax or sigmoid gating,
exp_probs_b, group-limited routing, normalized and scaled weights (metadata) and shared experts."""

from hybrid.model.arch.spec import ArchSpec

SPEC = ArchSpec(name="deepseek2", moe=True, moe_norm_weights=False, mla=True)
