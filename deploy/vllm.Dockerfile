# vLLM's image with adapter-fabric's LoRA resolver plugin (deploy/vllm-sidecar.yaml runs it):
#   docker build -f deploy/vllm.Dockerfile -t adapter-fabric-vllm:0.1.0 .
# The wheel is built from the clone and installed with the image's torch held (a constraint), so
# pip adds adapter-fabric's few pure-Python dependencies and replaces nothing vLLM needs.
# tests/project/test_install.py does the same into a fresh virtual environment; this image is
# not built by CI here.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.34.0
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY fabric ./fabric
COPY node ./node
RUN pip wheel --no-cache-dir --no-deps -w /dist .

FROM ${VLLM_IMAGE}
COPY --from=wheel /dist /tmp/dist
RUN python3 -c 'import torch; print(f"torch=={torch.__version__}")' > /tmp/hold-torch.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/hold-torch.txt /tmp/dist/adapter_fabric-*.whl \
    && python3 -c 'import adapter_fabric.integrations.vllm_resolver' \
    && rm -rf /tmp/dist /tmp/hold-torch.txt
