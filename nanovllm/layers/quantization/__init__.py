"""Quantized weights: one module per scheme behind one interface the linear layers call."""
