"""hilo data: document sources, tokenizers, packing and the resumable per-rank training loader."""

from .loader import TrainLoader, build_train_loader, iter_heldout_documents
from .tokenizer import load_tokenizer

__all__ = ["TrainLoader", "build_train_loader", "iter_heldout_documents", "load_tokenizer"]
