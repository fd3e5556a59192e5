"""Placement policies: which workers may host a manager, the Dask way.

Dragon places a DDict's managers by ``Policy`` (a host name, a GPU affinity), with
``managers_per_policy`` managers per policy.  Here a :class:`Policy` describes the
Dask workers that may host a manager: a worker (address or name), a host (the
machine's host name or the worker's IP address) and Dask worker resources (a worker
started with ``--resources "GPU=1"`` has ``{"GPU": 1}``; a policy asking
``{"GPU": 1}`` takes any worker that has at least that much).  Every field given must
hold; a policy with no field takes any worker.

A manager created under a policy keeps it in its layout: the orchestrator moves,
re-adopts and replicates it only onto workers that satisfy it, and parks it, saying
which policy no worker satisfies, when none does (see ``cluster.elastic``).

Pure functions, unit-tested without a cluster: :meth:`Policy.matches`,
:func:`policy_groups` (the constructor's ``policy=`` and ``managers_per_policy=``
as a list of ``(policy, count)``) and :func:`assign` (which worker hosts each manager).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .arguments import MAX_MANAGERS, check_int


def _resources(value: Any) -> tuple[tuple[str, float], ...]:
    """``value`` (a mapping or pairs of resource name and amount) as sorted pairs."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise TypeError(
            f"Policy resources must be a mapping of resource name to amount, got {value!r:.80}"
        ) from None
    out = {}
    for k, v in pairs:
        if (
            not isinstance(k, str)
            or not k
            or isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not math.isfinite(v)
            or v <= 0
        ):
            raise ValueError(
                f"Policy resources: {k!r}: {v!r} must be a resource name and a "
                "positive amount, e.g. {'GPU': 1}"
            )
        out[k] = float(v)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class Policy:
    """The workers that may host a manager (every field given must hold).

    Parameters
    ----------
    worker
        A worker's address (``tcp://10.0.0.5:40123``) or its name (``--name``).
    host
        A machine: its host name (Dragon's ``host_name``) or a worker's IP address.
    resources
        Dask worker resources that the worker must have at least, e.g. ``{"GPU": 1}``
        (Dragon's GPU affinity, the Dask way: start GPU workers with
        ``--resources "GPU=1"``).  Resources are not consumed: several managers may
        share one worker's ``GPU``.
    """

    worker: str | None = None
    host: str | None = None
    #: given as a mapping (or pairs); kept as sorted ``(name, amount)`` pairs (hashable)
    resources: Mapping[str, float] | tuple[tuple[str, float], ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("worker", "host"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(
                    f"Policy {name} must be a non-empty string or None, got {value!r:.80}"
                )
        object.__setattr__(self, "resources", _resources(self.resources or ()))

    def __repr__(self) -> str:
        given = [
            f"{k}={v!r}" for k, v in (("worker", self.worker), ("host", self.host)) if v is not None
        ]
        if self.resources:
            given.append(f"resources={dict(self.resources)!r}")  # (sorted pairs: stable)
        return f"Policy({', '.join(given)})"

    def matches(
        self,
        address: str,
        name: Any = None,
        host: str = "",
        hostname: str = "",
        resources: Mapping[str, float] | None = None,
    ) -> bool:
        """Whether the worker at ``address`` (its ``name``, IP address ``host``, machine
        ``hostname`` and ``resources``) satisfies this policy."""
        if self.worker is not None and self.worker not in (address, str(name)):
            return False
        if self.host is not None and self.host not in (host, hostname):
            return False
        have = resources or {}
        return all(have.get(k, 0) >= v for k, v in dict(self.resources).items())

    def to_dict(self) -> dict[str, Any]:
        """A plain form (msgpack, JSON), read back by :meth:`from_dict`."""
        return {"worker": self.worker, "host": self.host, "resources": dict(self.resources)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Policy:
        return cls(worker=d.get("worker"), host=d.get("host"), resources=d.get("resources", ()))


def as_policy(value: Any) -> Policy | None:
    """``value`` as a :class:`Policy` (from its :meth:`~Policy.to_dict` form), or ``None``."""
    if value is None or isinstance(value, Policy):
        return value
    if isinstance(value, Mapping):
        return Policy.from_dict(value)
    raise TypeError(f"not a Policy: {value!r:.80}")


def policy_groups(
    policy: Any, managers_per_policy: Any, managers_per_worker: int | None
) -> list[tuple[Policy, int | None]]:
    """The constructor's placement as ``(policy, managers)`` groups, Dragon's way.

    * ``Policy(...)``: every manager under it; ``managers`` ``None`` (the workers that
      satisfy it host ``managers_per_worker`` each, as without a policy);
    * ``[Policy, ...]``: ``managers_per_policy`` managers (default 1) per policy; as
      in Dragon ``managers_per_worker`` must then be ``None``;
    * ``{Policy: count, ...}``: ``count`` managers per policy.

    Raises
    ------
    TypeError
        Not a Policy, a list of them or a mapping of them to counts.
    ValueError
        An empty list, a count below 1, ``managers_per_policy`` beside a single
        policy or a mapping, ``managers_per_worker`` beside a list.
    """
    if policy is None:
        if managers_per_policy is not None:
            raise ValueError(
                f"managers_per_policy={managers_per_policy!r} needs policy=[...] (a list of Policy)"
            )
        return []
    if isinstance(policy, Policy):
        if managers_per_policy is not None:
            raise ValueError(
                "managers_per_policy goes with a list of policies; with one "
                "Policy give managers_per_worker= (managers on each worker that "
                "satisfies it)"
            )
        return [(policy, None)]
    if isinstance(policy, Mapping):
        if managers_per_policy is not None:
            raise ValueError(
                "policy={Policy: count} gives each policy's count: managers_per_policy must be None"
            )
        groups = list(policy.items())
    elif isinstance(policy, (list, tuple)):
        k = 1 if managers_per_policy is None else managers_per_policy
        check_int("managers_per_policy", k, 1, MAX_MANAGERS)
        if managers_per_worker is not None:
            raise ValueError(
                "with a list of policies, managers_per_policy gives the managers "
                "of each policy: managers_per_worker (managers_per_node) must be "
                "None, as in Dragon"
            )
        groups = [(p, k) for p in policy]
    else:
        raise TypeError(
            f"policy must be a Policy, a list of Policy or a mapping of Policy to "
            f"a count of managers, got {policy!r:.80}"
        )
    if not groups:
        raise ValueError("policy=[] places no manager: give at least one Policy")
    for p, count in groups:
        if not isinstance(p, Policy):
            raise TypeError(f"policy: {p!r:.80} is not a dask_ddict.Policy")
        check_int("managers per policy", count, 1, MAX_MANAGERS)
    if sum(c for _, c in groups) > MAX_MANAGERS:
        raise ValueError(
            f"the policies place {sum(c for _, c in groups)} managers; at most {MAX_MANAGERS}"
        )
    return groups


@dataclass(frozen=True)
class WorkerView:
    """What a policy looks at in a worker (see :meth:`Policy.matches`)."""

    address: str
    name: Any = None
    host: str = ""
    hostname: str = ""
    resources: Mapping[str, float] = field(default_factory=dict)

    def satisfies(self, policy: Policy | None) -> bool:
        """Whether this worker may host a manager under ``policy`` (any, if ``None``)."""
        return policy is None or policy.matches(
            self.address, self.name, self.host, self.hostname, self.resources
        )


def assign(
    groups: Sequence[tuple[Policy, int | None]],
    workers: Iterable[WorkerView],
    managers_per_worker: int,
) -> list[tuple[str, Policy]]:
    """Each manager's ``(worker address, policy)``, manager id order.

    A group without a count puts ``managers_per_worker`` managers on each worker
    that satisfies its policy; one with a count spreads its managers over those
    workers, each to the one hosting the fewest managers so far (then by address).

    Raises
    ------
    ValueError
        A policy that no worker satisfies, naming it and the workers there are.
    """
    workers = sorted(workers, key=lambda w: w.address)
    load: dict[str, int] = {w.address: 0 for w in workers}
    out: list[tuple[str, Policy]] = []
    for policy, count in groups:
        fit = [w.address for w in workers if w.satisfies(policy)]
        if not fit:
            raise ValueError(
                f"no worker satisfies {policy!r} (workers: {', '.join(load) or 'none'})"
            )
        if count is None:
            for w in fit:
                out += [(w, policy)] * managers_per_worker
                load[w] += managers_per_worker
            continue
        for _ in range(count):
            w = min(fit, key=lambda a: (load[a], a))
            load[w] += 1
            out.append((w, policy))
    return out


__all__ = ["Policy", "WorkerView", "as_policy", "assign", "policy_groups"]
