"""Authors write plans and kernels: `OfflineAuthor` (no model) and the LLM author share `base.Author`."""

from maxkernel.authors.base import (
    Attempt,
    Author,
    AuthorContext,
    AuthorError,
    Draft,
    Plan,
    Reflection,
    TileConfig,
)

__all__ = ["Attempt", "Author", "AuthorContext", "AuthorError", "Draft", "Plan", "Reflection", "TileConfig"]
