# iota-subnet miner / validator image.
#   CPU:   docker build -t iota-subnet .
#   CUDA:  docker build --build-arg VARIANT=cuda -t iota-subnet:cuda .
# A smaller CPU image takes torch from PyPI's CPU-only mirror of PyTorch wheels:
#   docker build --build-arg TORCH_INDEX=<PyTorch's CPU wheel index> -t iota-subnet .
# Run it with docker compose (docker-compose.yml) or:
#   docker run -e IOTA_ROLE=miner -e IOTA_EXTERNAL_IP=203.0.113.7 -p 8091:8091 \
#     -v ~/.bittensor/wallets:/root/.bittensor/wallets:ro -v iota-data:/data iota-subnet
# The install step is deploy/install.sh (tests/test_deploy.py runs it in a fresh virtual environment).
ARG VARIANT=cpu

FROM python:3.11-slim-bookworm AS base-cpu

FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 AS base-cuda
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*

FROM base-${VARIANT}
ARG VARIANT
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=
ENV PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false IOTA_CACHE=/data/cache
WORKDIR /app
COPY setup.py README.md ./
COPY iota_subnet ./iota_subnet
COPY neurons ./neurons
COPY configs ./configs
COPY deploy ./deploy
RUN VARIANT=${VARIANT} TORCH_SPEC=${TORCH_SPEC} TORCH_INDEX=${TORCH_INDEX} PYTHON=python3 \
    sh deploy/install.sh /opt/iota && rm -rf /root/.cache/pip
ENV PATH=/opt/iota/bin:$PATH
VOLUME ["/data"]
EXPOSE 8091 8092
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s CMD python3 -c \
    "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/metrics' % os.environ.get('IOTA_METRICS_PORT', os.environ.get('IOTA_PORT', '8091')), timeout=4)" || exit 1
ENTRYPOINT ["sh", "/app/deploy/entrypoint.sh"]
