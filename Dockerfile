# hilo on a CUDA machine: docker build -t hilo . && docker run --gpus all -it hilo python train.py trainer.device=cuda
FROM nvcr.io/nvidia/pytorch:25.01-py3

WORKDIR /workspace/hilo
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 WANDB_MODE=offline

# dependencies first (cached layer), then the source
COPY pyproject.toml README.md ./
RUN mkdir -p hilo_kernels models data eval_suites training \
    && touch hilo_kernels/__init__.py models/__init__.py data/__init__.py eval_suites/__init__.py training/__init__.py \
    && pip install -e ".[test]" \
    && (pip install --no-build-isolation "flash-attn>=2.6" || echo "flash-attn not built: hilo falls back to SDPA")
COPY . .
RUN pip install --no-deps -e .

CMD ["python", "train.py"]
