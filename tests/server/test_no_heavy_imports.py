"""The server is part of the torch-free control plane: importing it and building the app pulls in no
torch, numpy or transformers (checked in a fresh interpreter, where nothing else imported them first)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from infer_protocol.config import load_config
from infer_server import create_app
import infer_server.cli, infer_server.routes_openai, infer_server.routes_tokenize
create_app(load_config(environ={}))
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers', 'triton', 'numba'))
print(','.join(heavy))
"""


def test_server_imports_no_torch_numpy_transformers() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""
