"""The offline author: Pallas TPU kernels from the reference's jaxpr, deterministic and instant."""

from maxkernel.authors.offline.author import FUSION_LEVELS, OfflineAuthor

__all__ = ["FUSION_LEVELS", "OfflineAuthor"]
