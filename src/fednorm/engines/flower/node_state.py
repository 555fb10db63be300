"""What a SuperNode's clients keep between rounds, on the node's disk, so a stopped Flower run resumes.

Flower keeps a ClientApp's ``Context.state`` for one run only; a new ``flwr run`` (the resume of a stopped
run) starts with an empty one. A node started with the node config ``state-dir=DIR`` therefore also writes
each client's memory (:class:`~fednorm.engines.client_step.ClientMemory`: its local BN state, optimizer
state, client-algorithm state) to ``DIR/fednorm/<run id>/<method>/seed<k>/<client>/round<r>.pt`` after round r
(r rounds completed), and reads it back from there. The server resumes from its last checkpoint, which may
be older than the node's newest snapshot; so a node reads the newest snapshot at or before the round it is
asked about, deletes snapshots newer than the one it writes (they belong to rounds the resumed run redoes),
and keeps the snapshots the server's last possible checkpoint may still need (``checkpoint_every``).
The files never leave the node.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ...runs.store import atomic_write_bytes
from ..client_step import ClientMemory

_SNAPSHOT = re.compile(r"round(\d+)\.pt$")


class NodeStateStore:
    """Client memories of one node under ``root``, one file per (cell, client, completed round)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _folder(self, prefix: str) -> Path:
        return self.root / prefix

    def rounds(self, prefix: str) -> list[int]:
        folder = self._folder(prefix)
        if not folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _SNAPSHOT.match(p.name)))

    def load(self, prefix: str, at_round: int) -> ClientMemory:
        """The memory as of ``at_round`` completed rounds: the newest snapshot at or before it (empty if none)."""
        usable = [r for r in self.rounds(prefix) if r <= at_round]
        if not usable:
            return ClientMemory()
        path = self._folder(prefix) / f"round{usable[-1]}.pt"
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a corrupt snapshot gets one clear message
            raise RuntimeError(f"the node's client state {path} is unreadable ({exc}); delete it and resume the run "
                               "from an earlier checkpoint, or restart the run") from exc
        return ClientMemory(saved["local_state"], saved["optimizer_state"], saved["algorithm_state"])

    def save(self, prefix: str, completed_round: int, memory: ClientMemory, checkpoint_every: int = 1) -> None:
        """Write the memory after ``completed_round`` rounds; drop newer snapshots (a redone future) and the
        ones older than what the server's last checkpoint (a multiple of ``checkpoint_every`` before this
        round) may need."""
        folder = self._folder(prefix)
        folder.mkdir(parents=True, exist_ok=True)
        state = {"local_state": memory.local_state, "optimizer_state": memory.optimizer_state,
                 "algorithm_state": memory.algorithm_state}
        atomic_write_bytes(folder / f"round{completed_round}.pt", lambda fh: torch.save(state, fh))
        rounds = self.rounds(prefix)
        oldest_checkpoint = max(0, ((completed_round - 1) // checkpoint_every) * checkpoint_every)
        needed = max([r for r in rounds if r <= oldest_checkpoint], default=None)
        for r in rounds:
            if r > completed_round or (needed is not None and r < needed):
                (folder / f"round{r}.pt").unlink(missing_ok=True)
