"""Names no other test uses, so that tests sharing the services never meet."""

from __future__ import annotations

import uuid


def unique(prefix: str) -> str:
    """A name no other test uses: ``<prefix>_<12 hex>``."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"
