# moe-transport services image: moe-worker and moe-gateway (tcp between containers).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
WORKDIR /app
COPY setup.cfg pyproject.toml README.md ./
COPY transport ./transport
COPY workers ./workers
COPY gateway ./gateway
COPY bench ./bench
RUN pip install --no-cache-dir .
EXPOSE 5000 7000 9100
CMD ["moe-gateway", "--help"]
