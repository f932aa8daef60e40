"""hilo data: document sources, tokenizers, packing and the resumable per-rank training loader."""

from .loader import TrainLoader, build_train_loader, iter_heldout_documents
from .tokenizer import load_tokenizer

__all__ = ["load_tokenizer", "build_train_loader", "iter_heldout_documents", "TrainLoader"]
