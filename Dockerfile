# MegatronApp on NVIDIA's PyTorch container: the base image's CUDA torch is kept, the project and its
# Python dependencies are installed by scripts/install.sh (the same as outside a container), and the
# C++ transport is built against that torch (with its CUDA IPC part where nvcc is present).
# Build:  docker build -t megatronapp .     (docker/README.md: build arguments, run line, run scripts)
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.04-py3
FROM ${BASE_IMAGE}

# NODE_VERSION (e.g. 20.19.5): install Node.js from nodejs.org and build the MegaScope page into its
# dist/, which the generation server then serves; empty (the default): no Node.js in the image.
ARG NODE_VERSION=""
# The user the container runs as; an existing user of that id (the NGC image's "ubuntu") is reused.
ARG USER_UID=1000

ENV MEGATRONAPP_HOME=/opt/megatronapp \
    VENV=/opt/megatronapp-venv \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
ENV PATH=${VENV}/bin:${PATH}

# NVIDIA's image has Python, its headers and a compiler; a plain Debian/Ubuntu base (CI) gets them here.
RUN if ! { command -v g++ && python3 -c "import sysconfig, os, ensurepip; \
              assert os.path.exists(sysconfig.get_paths()['include'] + '/Python.h')"; } >/dev/null 2>&1; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv python3-dev g++ ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi

RUN if [ -n "${NODE_VERSION}" ]; then \
        command -v curl >/dev/null || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
            --no-install-recommends curl xz-utils ca-certificates && rm -rf /var/lib/apt/lists/*; }; \
        curl -fsSL "https://nodejs.org/dist/v${NODE_VERSION}/node-v${NODE_VERSION}-linux-x64.tar.xz" \
            | tar -xJ -C /usr/local --strip-components=1; \
    fi

# The virtual environment sees the base image's packages (its CUDA torch among them), so that
# scripts/install.sh finds torch and keeps it instead of installing another one.
RUN python3 -m venv --system-site-packages "${VENV}"

WORKDIR ${MEGATRONAPP_HOME}
# One install step after the whole copy: the editable install builds the transport into the package
# folder, so it needs the code (a code change reruns it; the system layers above stay cached).
COPY . .
RUN bash scripts/install.sh \
    && if [ -n "${NODE_VERSION}" ]; then \
        cd tools/visualization/transformer-visualize && npm ci && npm run build \
        && rm -rf node_modules ~/.npm; \
    fi

# Not root where the base allows it. The code and the environment stay root-owned (read-only to the
# user): the run scripts write only under the output directory they are given.
RUN getent passwd "${USER_UID}" >/dev/null || useradd --create-home --uid "${USER_UID}" --shell /bin/bash megatron
USER ${USER_UID}
CMD ["bash"]
