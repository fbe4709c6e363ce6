"""BitNet b1.58 quantization-aware training primitives (ternary weights, 8-bit activations, sub-norms,
``BitLinear``), used by the experts, the MH-MoE projections and the attention. The packed 2-bit export
of a trained model is an export format: :mod:`mhmoe.integrations.bitnet_packed`. See docs/BITNET.md."""
