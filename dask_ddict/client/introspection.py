"""What a handle tells about its dictionary: options, locality, statistics.

Read-only properties shared by every handle (:class:`~dask_ddict.DDict`
inherits them), its statistics and this process's timings; nothing here
changes state.  (The local views, ``local_keys()`` and the others, live with
``keys()`` in :mod:`.handle`.)
"""

from __future__ import annotations

import distributed
from distributed import Client

from ..arguments import check_bool
from ..layout import Layout
from ..stats import DDictManagerStats
from ..transport import timing
from ..transport.ops import Stats
from .base import HandleBase


class Introspection(HandleBase):
    """Properties of a handle: options, where managers are, which are local, stats."""

    @property
    def _layout(self) -> Layout:
        """The dictionary's layout, read by an open handle (a closed one raises)."""
        self._check()
        return self._core.layout

    @property
    def client(self) -> Client:
        """The Dask client of this handle (the embedded cluster's, if it owns one)."""
        self._check()
        return self._core.client

    @property
    def timeout(self) -> float | None:
        self._check()
        return self._timeout

    @property
    def lifetime(self) -> str:
        """``"client"`` (released with the clients that hold it) or ``"cluster"``."""
        return self._layout.lifetime

    @property
    def wait_for_keys(self) -> bool:
        return self._layout.options.wait_for_keys

    @property
    def wait_for_writers(self) -> bool:
        return self._layout.options.wait_for_writers

    @property
    def working_set_size(self) -> int:
        return self._layout.options.working_set_size

    @property
    def num_managers(self) -> int:
        return self._layout.num_managers

    @property
    def manager_workers(self) -> list[str]:
        """Address of the worker hosting each manager (as the orchestrator has it now:
        managers move when workers leave or join)."""
        self._check()
        return self._core.fresh().manager_workers

    @property
    def manager_nodes(self) -> list[str]:
        """Dragon's name of :attr:`manager_workers`: a Dask worker stands for a Dragon
        node, so where Dragon lists each manager's node, this lists its worker's address."""
        return self.manager_workers

    @property
    def local_managers(self) -> list[int]:
        """Managers on this host (now: see :attr:`manager_workers`)."""
        self._check()
        return [m.manager_id for m in self._core.fresh().managers if self._core.is_local(m)]

    @property
    def local_manager(self) -> int | None:
        """A manager hosted for this worker (in a task), else one on this host, else ``None``.

        Managers run in a host process beside their worker, not in it; "hosted
        for" survives worker restarts (it follows the worker's nanny).
        """
        try:
            w = distributed.get_worker()
        except ValueError:
            w = None
        if w is not None:
            for m in self._core.fresh().managers:
                if m.worker == w.address or (w.nanny and m.supervisor == w.nanny):
                    return m.manager_id
        local = self.local_managers
        return local[0] if local else None

    @property
    def main_manager(self) -> int:
        """The local manager if any, else one chosen from this handle's client id."""
        local = self.local_manager
        return local if local is not None else self._client_id % self.num_managers

    @property
    def empty_managers(self) -> list[int]:
        """Managers that came back empty after a restart (none without restart)."""
        return list(self._layout.extra.get("empty_managers", []))

    @property
    def stats(self) -> list[DDictManagerStats]:
        """One entry per manager (or the chosen one), sorted by manager id."""
        return self._core.each(Stats(self._timeout), self._managers())

    @property
    def dstats(self) -> dict[int, DDictManagerStats]:
        return {s.manager_id: s for s in self.stats}

    def _repr_html_(self) -> str:
        """Jupyter's view: name, managers, hosts, keys and bytes, checkpoint.

        Never raises: a manager that cannot answer is shown with its error.
        """
        from ..display import dict_html, summarize

        answers: dict[int, DDictManagerStats | BaseException] = {}
        if not self._core.closed:
            for info in self._core.layout.managers:
                if info.lost:
                    continue
                try:
                    answers[info.manager_id] = self._core.channel(info.manager_id).call(
                        Stats(self._timeout)
                    )
                except Exception as e:  # noqa: BLE001 - shown in its row
                    answers[info.manager_id] = e
        return dict_html(summarize(self._core.layout, answers, checkpoint=self._chkpt))

    # -- this process's timings (Dragon's client profile) ------------------------------

    def profile(self) -> timing.Profile:
        """This process's timings of the operations it sent since :meth:`profile_reset`.

        Dragon's client timing report (0.13.2): for each operation (``get``,
        ``put``, ``get_many``, a broadcast such as ``len (broadcast)`` as one), how
        many, their total and mean time, and the p50, p99 and longest (percentiles
        of up to 1,024 samples per operation, each kept with the same chance).
        ``print(d.profile())`` prints the table; its ``operations`` hold the numbers.

        Timings are off until :meth:`profile_reset` turns them on (or
        ``ddict.profile: true``, in every process from its start): unasked, they
        cost the key path one flag read per operation.  They are the process's,
        every handle and thread adding to them (Dragon's are one client object's);
        a task's are its worker's.  What is timed: every operation sent to one
        manager (a put, a get, ``in``, ``pop``, a page of an iteration,
        ``end_batch_put``'s answer, ...), every broadcast and ``get_many``, as one
        each; the records a batch or :meth:`update` streams are not timed apart,
        nor the requests an :class:`~dask_ddict.AsyncDDict` event loop pipelines
        itself.
        """
        self._check()
        return timing.report()

    def profile_reset(self, enable: bool = True) -> None:
        """Forget this process's timings and time its operations from now on
        (``enable=False``: stop timing them).  See :meth:`profile`."""
        self._check()
        timing.reset(check_bool("enable", enable))
