# Image for elasticdl_strategy jobs: the same image runs the master (coordinator)
# and the workers; the command decides which. Not built in CI (no Docker engine
# there); see README.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first, in their own layer, so code changes don't reinstall TensorFlow.
# --build-arg EXTRAS=[gpu] adds TensorFlow's CUDA libraries, for pods with --gpu 1.
ARG EXTRAS=""
WORKDIR /opt/elasticdl_strategy
COPY setup.py README.md ./
RUN mkdir elasticdl_strategy && touch elasticdl_strategy/__init__.py \
    && pip install "./${EXTRAS}" \
    && pip uninstall -y elasticdl_strategy \
    && rm -rf elasticdl_strategy build ./*.egg-info

COPY elasticdl_strategy ./elasticdl_strategy
RUN pip install --no-deps . && rm -rf build ./*.egg-info
# The examples, so that the image can run them as they are (see README, Kubernetes).
COPY examples ./examples

RUN useradd --create-home --uid 10001 edl
USER 10001
WORKDIR /home/edl

ENTRYPOINT ["elasticdl-strategy"]
CMD ["--help"]
