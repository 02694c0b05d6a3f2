# fleetrl services image: one image, each compose service picks its entry point (`fleetrl <service>`).
# CPU by default; the GPU override (docker-compose.gpu.yml) builds with TORCH_INDEX for CUDA wheels
# and INSTALL_EXTRAS=vllm.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG INSTALL_EXTRAS=""

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TOKENIZERS_PARALLELISM=false FLEETRL_CACHE_DIR=/cache
WORKDIR /app

RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY services ./services
COPY examples ./examples
RUN pip install ".${INSTALL_EXTRAS:+[${INSTALL_EXTRAS}]}" \
 && python -c "from services.common import models; models.load('smollm2-135m')"

VOLUME ["/runs", "/cache"]
ENTRYPOINT ["fleetrl"]
CMD ["--help"]
