"""Hand-written kernels used by the hccompile backend."""
