"""`python -m infer`: batch generation with DFlash speculative decoding (see infer.cli)."""
