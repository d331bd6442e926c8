"""The de-duplicating reader under the import path it has always had (:mod:`harvester.client.dedup`)."""

from harvester.client.dedup import DedupReader, DedupState

__all__ = ["DedupReader", "DedupState"]
