# moe-transport services image: moe-worker and moe-gateway (tcp between containers).
# The base is pinned to an exact tag (Python patch release and Debian release), so a rebuild
# does not silently move to another Python; bump it on purpose.
FROM python:3.11.9-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# an unprivileged user to run as (no login, no home)
RUN groupadd --system --gid 10001 moe \
 && useradd --system --uid 10001 --gid moe --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin moe
WORKDIR /app
# Dependencies first, from setup.cfg alone: this layer is rebuilt only when the metadata
# changes, not on every source edit.
COPY setup.cfg pyproject.toml ./
RUN python -c "import configparser; c = configparser.ConfigParser(); c.read('setup.cfg'); print(c['options']['install_requires'].strip())" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
# then the source, installed without touching the dependencies again; gcc only for as long
# as setup.py compiles shm://'s and tcp://'s fast paths (transport/_shmfast.c and
# transport/_tcpfast.c; the image keeps the .so files).
# rdma://'s (transport/_rdmafast.c) needs verbs.h and pyverbs, which this tcp/shm image does
# not carry: setup.py leaves it out (it is optional), and rdma:// is not served from it.
COPY README.md setup.py ./
COPY transport ./transport
COPY workers ./workers
COPY gateway ./gateway
COPY bench ./bench
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install --no-deps . && (cd / && python -c "import transport._shmfast, transport._tcpfast") \
 && apt-get purge -y --auto-remove gcc libc6-dev && rm -rf /var/lib/apt/lists/* build *.egg-info
# the commit, for moe_build_info (docker build --build-arg MOE_BUILD_COMMIT=$(git rev-parse HEAD) .)
ARG MOE_BUILD_COMMIT=unknown
ENV MOE_BUILD_COMMIT=${MOE_BUILD_COMMIT}
USER moe:moe
# 5000 workers, 7000 the gateway, 9632 metrics and health (--metrics-port alone means 9632)
EXPOSE 5000 7000 9632
# liveness: the service's serve loop is turning (/healthz); run the services with
# --metrics-port 9632 --metrics-addr 0.0.0.0 (as docker-compose.yml does). python, not curl:
# the slim image has none.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9632/healthz', timeout=4)"]
CMD ["moe-gateway", "--help"]
