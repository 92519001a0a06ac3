# SuperExec image that can run pollen's ServerApp and ClientApp (Flower 1.39, process isolation).
#
# Built by deploy/docker/compose.yaml from the repository root:
#   docker compose -f deploy/docker/compose.yaml build
# TORCH_INDEX_URL picks the torch build: .../whl/cpu (default, amd64 and arm64),
# .../whl/cu126 (CUDA 12.6 on amd64), .../whl/cu128, ... (see https://pytorch.org/get-started/locally/).
ARG FLWR_VERSION=1.39.0
FROM flwr/superexec:${FLWR_VERSION}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY --chown=app:app pyproject.toml README.md ./
COPY --chown=app:app pollen ./pollen
# torch/torchvision first, from the chosen index; then pollen and the rest from PyPI. The image
# already has flwr 1.39: drop the flwr[simulation] requirement (Ray is not needed on a node).
RUN python -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch torchvision \
    && sed -i 's/.*flwr\[simulation\].*//' pyproject.toml \
    && python -m pip install --no-cache-dir . \
    && python -c "import flwr, torch, pollen.client_app, pollen.server_app; print('flwr', flwr.__version__, 'torch', torch.__version__)"

ENV FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
ENTRYPOINT ["flower-superexec"]
