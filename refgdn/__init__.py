"""refgdn: the readable PyTorch oracle for Gated DeltaNet (float64-capable, autograd-ready).

Ops (shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; state [N, HV, K, V]):
    recurrent_gated_delta_rule   the time loop, the base truth
    fused_recurrent_gated_delta_rule   the same under fla 0.6.0's name and argument order
    chunk_gated_delta_rule       the chunked WY/UT form (stages in refgdn.delta_rule)
    causal_conv1d, causal_conv1d_update
    gdn_gating, l2norm
    rms_norm_gated               the layer's output norm, gated by z (fla's name and argument order)
    rms_norm                     the model's plain RMSNorm (fla's name and order; unit_offset: 1 + weight)
Backward, stage by stage (the twins of fast's backward kernels; refgdn's own gradients are autograd):
refgdn.delta_rule_bwd, refgdn.conv_bwd.
Serving (refgdn.serving): GDNStateCache, gdn_prefill, gdn_decode, gdn_verify, gdn_accept, gdn_materialize —
decode and speculative verify against a slot cache, with rollback to the accepted prefix.
"""
from .conv import causal_conv1d, causal_conv1d_update
from .delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, recurrent_gated_delta_rule
from .gating import gdn_gating, l2norm
from .norm import rms_norm, rms_norm_gated
from .serving import GDNStateCache, gdn_accept, gdn_decode, gdn_materialize, gdn_prefill, gdn_verify

__all__ = ["recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_gated_delta_rule", "causal_conv1d",
           "causal_conv1d_update", "gdn_gating", "l2norm", "rms_norm_gated", "rms_norm", "GDNStateCache", "gdn_prefill",
           "gdn_decode", "gdn_verify", "gdn_accept", "gdn_materialize"]
