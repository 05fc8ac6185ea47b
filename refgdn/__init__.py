"""refgdn: the readable PyTorch oracle for Gated DeltaNet (float64-capable, autograd-ready)."""
