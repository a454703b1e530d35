"""Pure-PyTorch reference backend."""
