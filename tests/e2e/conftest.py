"""The e2e fixtures (`embedded_model_dir`, `smol_cluster`) live in tests/conftest.py: the frontend's
browser tests share the same session-wide cluster."""
