"""What a SuperNode's clients keep between rounds: one snapshot per completed round, on the node's disk (a
stopped Flower run resumes) or in its run context.

Flower keeps a ClientApp's ``Context.state`` for one run only; a new ``flwr run`` (the resume of a stopped
run) starts with an empty one. A node started with the node config ``state-dir=DIR`` therefore writes
each client's memory (:class:`~fednorm.engines.client_step.ClientMemory`: its local BN state, optimizer
state, client-algorithm state) to ``DIR/fednorm/<run id>/<method>/seed<k>/<client>/round<r>.pt`` after round r
(r rounds completed), and reads it back from there (:class:`NodeStateStore`); a node without one keeps the same
snapshots in ``Context.state`` (:class:`ContextStateStore`), which Flower never sends anywhere.
The server names the snapshot to read (``CellRequest.state_round``: the round after which the client's reply
last went into the global model). Other snapshots are not the client's state: newer ones belong to rounds a
resumed run redoes (the server resumes from its last checkpoint, which may be older than the node's newest
snapshot) or to replies the server did not use (late or malformed). Writing a snapshot deletes those (every
snapshot after the one it started from) and keeps the older ones the server's last possible checkpoint may still
name (``checkpoint_every``). The snapshots never leave the node.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import torch
from flwr.app import ConfigRecord, RecordDict

from ...runs.store import atomic_write_bytes
from ..client_step import ClientMemory
from .messages import to_arrays

_SNAPSHOT = re.compile(r"round(\d+)\.pt$")


class SnapshotStore:
    """Client memories kept per (cell, client, completed round) under a prefix naming the cell and client; the
    storage is the subclass's (``rounds``, ``read``, ``_write``, ``_delete``)."""

    def rounds(self, prefix: str) -> list[int]:
        """The rounds of the client's snapshots, ascending."""
        raise NotImplementedError

    def read(self, prefix: str, completed_round: int) -> ClientMemory:
        """The snapshot written after ``completed_round`` rounds, which must exist."""
        raise NotImplementedError

    def _write(self, prefix: str, completed_round: int, memory: ClientMemory) -> None:
        raise NotImplementedError

    def _delete(self, prefix: str, completed_round: int) -> None:
        raise NotImplementedError

    def newest(self, prefix: str, at_round: int) -> int | None:
        """The newest snapshot's round at or before ``at_round`` (None if there is none)."""
        return max((r for r in self.rounds(prefix) if r <= at_round), default=None)

    def load(self, prefix: str, at_round: int) -> ClientMemory:
        """The memory as of ``at_round`` completed rounds when the server does not name the snapshot (an older
        fednorm): the newest snapshot at or before it (empty if none)."""
        newest = self.newest(prefix, at_round)
        return ClientMemory() if newest is None else self.read(prefix, newest)

    def save(self, prefix: str, completed_round: int, memory: ClientMemory, checkpoint_every: int = 1,
             started_from: int | None = None) -> None:
        """Write the memory after ``completed_round`` rounds. Drop the snapshots after ``started_from`` (the one
        this memory was read from, -1: none; None: unknown, then only the newer ones): they are of rounds a
        resumed run redoes, or of replies the server did not use. Drop the ones older than what the server's
        last checkpoint (a multiple of ``checkpoint_every`` before this round) may name."""
        self._write(prefix, completed_round, memory)
        after = completed_round if started_from is None else started_from
        for r in self.rounds(prefix):
            if r != completed_round and r > after:
                self._delete(prefix, r)
        rounds = self.rounds(prefix)
        oldest_checkpoint = max(0, ((completed_round - 1) // checkpoint_every) * checkpoint_every)
        needed = max([r for r in rounds if r <= oldest_checkpoint], default=None)
        for r in rounds:
            if needed is not None and r < needed:
                self._delete(prefix, r)


class NodeStateStore(SnapshotStore):
    """Client memories of one node under ``root``, one file per (cell, client, completed round): they survive
    the run, so a resumed run finds them."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _folder(self, prefix: str) -> Path:
        return self.root / prefix

    def rounds(self, prefix: str) -> list[int]:
        folder = self._folder(prefix)
        if not folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _SNAPSHOT.match(p.name)))

    def read(self, prefix: str, completed_round: int) -> ClientMemory:
        path = self._folder(prefix) / f"round{completed_round}.pt"
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a corrupt snapshot gets one clear message
            raise RuntimeError(f"the node's client state {path} is unreadable ({exc}); delete it and resume the run "
                               "from an earlier checkpoint, or restart the run") from exc
        return ClientMemory(saved["local_state"], saved["optimizer_state"], saved["algorithm_state"])

    def _write(self, prefix: str, completed_round: int, memory: ClientMemory) -> None:
        folder = self._folder(prefix)
        folder.mkdir(parents=True, exist_ok=True)
        state = {"local_state": memory.local_state, "optimizer_state": memory.optimizer_state,
                 "algorithm_state": memory.algorithm_state}
        atomic_write_bytes(folder / f"round{completed_round}.pt", lambda fh: torch.save(state, fh))

    def _delete(self, prefix: str, completed_round: int) -> None:
        (self._folder(prefix) / f"round{completed_round}.pt").unlink(missing_ok=True)


class ContextStateStore(SnapshotStore):
    """Client memories of a node without a state-dir, in its ``Context.state`` (one run of Flower's: gone when the
    node restarts), under ``<prefix>/round<r>/{local,algorithm,optimizer}``."""

    def __init__(self, state: RecordDict) -> None:
        self.state = state

    def rounds(self, prefix: str) -> list[int]:
        pattern = re.compile(re.escape(prefix) + r"/round(\d+)/local$")
        return sorted(int(m.group(1)) for key in self.state.keys() if (m := pattern.match(key)))

    def read(self, prefix: str, completed_round: int) -> ClientMemory:
        key = f"{prefix}/round{completed_round}"
        memory = ClientMemory(dict(self.state.array_records[f"{key}/local"].to_torch_state_dict()), None,
                              dict(self.state.array_records[f"{key}/algorithm"].to_torch_state_dict()))
        if f"{key}/optimizer" in self.state:
            memory.optimizer_state = torch.load(io.BytesIO(self.state.config_records[f"{key}/optimizer"]["torch"]),
                                                weights_only=True)
        return memory

    def _write(self, prefix: str, completed_round: int, memory: ClientMemory) -> None:
        key = f"{prefix}/round{completed_round}"
        self.state[f"{key}/algorithm"] = to_arrays(memory.algorithm_state)
        if memory.optimizer_state is not None:
            buffer = io.BytesIO()
            torch.save(memory.optimizer_state, buffer)
            self.state[f"{key}/optimizer"] = ConfigRecord({"torch": buffer.getvalue()})
        else:
            self.state.pop(f"{key}/optimizer", None)
        self.state[f"{key}/local"] = to_arrays(memory.local_state)  # last: the key that marks the snapshot whole

    def _delete(self, prefix: str, completed_round: int) -> None:
        for part in ("local", "algorithm", "optimizer"):
            self.state.pop(f"{prefix}/round{completed_round}/{part}", None)

    def forget(self, prefix: str) -> None:
        """Drop every snapshot under ``prefix`` (a finished cell's: :func:`~.messages.cell_prefix`)."""
        for key in [k for k in self.state.keys() if k.startswith(prefix + "/")]:
            del self.state[key]
