"""textkit: small text helpers."""

from textkit.paginate import describe, page_count, paginate

__all__ = ["describe", "page_count", "paginate"]
