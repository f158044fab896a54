"""Who owns each sequence on the draft and the verifier, and for how long. Plain Python: no torch, no gRPC.

Every gateway process is an *instance* (a fresh id at each start) of a *name* (stable across restarts:
the pod, or --name). An instance takes a lease when it connects and renews it every few seconds; the
sequences it creates belong to it. Three ways a sequence is freed without its owner's Release:

* takeover: an instance that connects with a name frees every sequence of earlier instances of that
  name (a restarted gateway frees what its predecessor left behind, at once);
* expiry: an owner that has not renewed within `ttl_s` is gone, with all its sequences;
* anonymous sequences (created without an owner: tools, tests) expire when untouched for `ttl_s`.

Worked example (ttl 10): at t=0 instance "gw.a" (name "gw") creates s1, s2. At t=3 "gw.a" is killed and
"gw.b" connects as "gw": takeover frees [s1, s2]. Had nobody connected, `expired(10.1)` would free them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ANONYMOUS = ""


@dataclass
class Owner:
    name: str
    expires_at: float
    seqs: set[str] = field(default_factory=set)


@dataclass
class LeaseTable:
    ttl_s: float
    owners: dict[str, Owner] = field(default_factory=dict)  # instance id -> owner
    _owner_of: dict[str, str] = field(default_factory=dict)  # seq id -> instance id (ANONYMOUS for none)
    _anon_expiry: dict[str, float] = field(default_factory=dict)  # anonymous seq id -> expiry

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {self.ttl_s}")

    def connect(self, instance: str, name: str, now: float) -> list[str]:
        """Take (or renew) `instance`'s lease. With a name, earlier instances of that name are gone:
        returns their sequences, which the caller frees."""
        if not instance:
            raise ValueError("instance id must not be empty")
        freed: list[str] = []
        if name:
            for other in [i for i, o in self.owners.items() if o.name == name and i != instance]:
                freed += self._drop_owner(other)
        self.renew(instance, now, name)
        return freed

    def renew(self, instance: str, now: float, name: str = "") -> None:
        """Extend the lease; an instance not known here (this service restarted, or its lease ran out)
        gets a new one."""
        owner = self.owners.get(instance)
        if owner is None:
            self.owners[instance] = Owner(name=name, expires_at=now + self.ttl_s)
            return
        owner.expires_at = now + self.ttl_s
        owner.name = name or owner.name

    def add(self, seq_id: str, instance: str, now: float) -> None:
        """Record a new sequence of `instance` (ANONYMOUS: a sequence with its own lease)."""
        if instance == ANONYMOUS:
            self._anon_expiry[seq_id] = now + self.ttl_s
        else:
            if instance not in self.owners:
                self.renew(instance, now)
            self.owners[instance].seqs.add(seq_id)
        self._owner_of[seq_id] = instance

    def touch(self, seq_ids: list[str], now: float) -> None:
        """A call used these sequences: anonymous ones live on (owned ones live as long as their owner)."""
        for s in seq_ids:
            if s in self._anon_expiry:
                self._anon_expiry[s] = now + self.ttl_s

    def remove(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            instance = self._owner_of.pop(s, None)
            if instance is None:
                continue
            if instance == ANONYMOUS:
                self._anon_expiry.pop(s, None)
            elif instance in self.owners:
                self.owners[instance].seqs.discard(s)

    def expired(self, now: float) -> list[str]:
        """Sequences whose lease ran out (their owners are forgotten too); the caller frees them."""
        freed: list[str] = []
        for instance in [i for i, o in self.owners.items() if o.expires_at < now]:
            freed += self._drop_owner(instance)
        for s in [s for s, t in self._anon_expiry.items() if t < now]:
            self.remove([s])
            freed.append(s)
        return freed

    def owner_of(self, seq_id: str) -> str | None:
        return self._owner_of.get(seq_id)

    def __len__(self) -> int:
        return len(self._owner_of)

    def _drop_owner(self, instance: str) -> list[str]:
        owner = self.owners.pop(instance)
        seqs = sorted(owner.seqs)
        for s in seqs:
            self._owner_of.pop(s, None)
        return seqs
