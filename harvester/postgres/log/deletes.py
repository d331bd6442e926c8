"""The log source's per-batch delete (the :class:`~harvester.postgres.log.parts.Finish` of a table
without a retention window): a batch's rows are deleted in one fenced statement, and the slot is
confirmed past every transaction whose records are all done right after it. The table is what is
done: a new term skips the records whose rows are gone (:class:`.rows.TableRows`)."""

from __future__ import annotations

from collections.abc import Sequence

from harvester.core.protocols import SourceSample
from harvester.postgres.log.parts import Ledger


class Deletes:
    """Each batch's rows deleted before the slot moves past them."""

    def bind(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def acquired(self) -> None:
        """Nothing stored to read: the rows an earlier term deleted are gone."""

    def marked(self) -> None:
        """Nothing to sweep: delivered rows are deleted as they complete."""

    def purge(self, ids: Sequence[int]) -> None:
        """Delete delivered records (one fenced statement), then confirm every transaction whose
        records are all done."""
        self._ledger.delete_rows(ids)
        self.done(ids)

    def purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        """Delete the rows and move the checkpoint position (one fenced statement), then confirm
        every transaction whose records are all done. The position moves only past checkpoints whose
        transactions are confirmed by then: a checkpoint the position has passed is never recovered
        again (should the confirmation be lost, their rows are gone, which a new term's reader
        checks)."""
        ledger = self._ledger
        with ledger.state:
            target, _, safe = ledger.checkpointed(ids, position)
        ledger.delete_rows(ids, safe)
        ledger.confirm(target)

    def done(self, ids: Sequence[int], *, purged: bool = True) -> None:
        ledger = self._ledger
        with ledger.state:
            target = ledger.completed(ids, follow=purged)
        ledger.confirm(target)

    def advance_to(self, lsn: int) -> None:
        """Confirm ``lsn`` after checking, in a fenced statement, that the epoch is still ours."""
        self._ledger.fence.check_epoch()
        self._ledger.confirm(lsn)

    def durable(self, ids: Sequence[int]) -> list[int]:
        """All of ``ids``: a purge deleted them."""
        return list(ids)

    def head(self) -> tuple[int, float | None]:
        """The table's head, as mark-purge samples it."""
        return self._ledger.table_head()

    def sample(self, sample: SourceSample, leads: bool) -> SourceSample:
        return sample

    def before_harvest(self) -> None:
        """Nothing: the rows in the table are the ones not delivered."""

    def close(self) -> None:
        """Nothing: delivered rows are already deleted."""
