# RustInfer on one NVIDIA GPU. Build: `docker build -t rustinfer .`; run: see docs/deployment.md.
# The official CUDA runtime base brings the user-space libraries the driver pairs with; torch's own CUDA
# wheels (from the lock) bring the rest. Triton compiles small host stubs at run time, hence gcc.
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=ghcr.io/astral-sh/uv:0.13.9 /uv /uvx /usr/local/bin/

ENV UV_PYTHON=3.12 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1
WORKDIR /opt/rustinfer
COPY . .
# The README's set-up (`uv sync`), from the committed lock, without the test-only group.
RUN uv sync --locked --no-dev && rm -rf /root/.cache/uv

# Every config field is a RUSTINFER_<FIELD> variable (docs/configuration.md); `docker run -e` overrides these.
ENV PATH=/opt/rustinfer/.venv/bin:$PATH \
    HF_HOME=/models/huggingface \
    RUSTINFER_HOST=0.0.0.0 \
    RUSTINFER_PORT=8000
EXPOSE 8000
# /ready is 200 only with the model loaded and the worker alive (docs/api.md); loading can take minutes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD curl -fsS "http://127.0.0.1:${RUSTINFER_PORT}/ready" || exit 1
ENTRYPOINT ["rustinfer", "serve"]
