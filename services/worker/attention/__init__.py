from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.backend import AttentionBackend, get_attention_backend
from services.worker.attention.layer import Attention

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]
