# adapter-fabric node image. CPU build by default:
#   docker build -t adapter-fabric:0.1.0 .
# CUDA build (a CUDA runtime base and the matching torch wheels):
#   docker build -t adapter-fabric:0.1.0-cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 .
# Images are not built by CI here (see README "Running on Kubernetes").
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# CUDA bases ship without Python; the python image has it already.
RUN if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
        && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /opt/adapter-fabric
COPY pyproject.toml setup.py README.md ./
COPY fabric ./fabric
COPY node ./node
COPY protos ./protos

# The project's own install path (pip install .), torch first from the chosen index so
# the CPU image does not pull multi-GB CUDA wheels.
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.2,<3" \
    && /opt/venv/bin/pip install ".[k8s]" \
    && /opt/venv/bin/fabric-node --version

RUN groupadd --gid 10001 fabric && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin fabric \
    && mkdir -p /var/lib/fabric && chown fabric:fabric /var/lib/fabric
USER 10001:10001
ENV PATH=/opt/venv/bin:$PATH \
    FABRIC_LISTEN=0.0.0.0:50051 \
    FABRIC_METRICS_LISTEN=0.0.0.0:9100 \
    FABRIC_STORE=/var/lib/fabric/store
EXPOSE 50051 9100
VOLUME ["/var/lib/fabric"]
ENTRYPOINT ["fabric-node"]
