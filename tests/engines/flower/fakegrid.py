"""A Grid that delivers messages to ClientApps in this process: the server logic without a network.

Each node has its own ``Context`` (state kept across messages, as a SuperNode does). ``tamper`` may
replace a node's reply (a bad client), ``dead`` nodes never answer (a crashed SuperNode), and every
message content seen on the wire is kept in ``sent`` / ``received`` for inspection.
"""

from __future__ import annotations

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


class Late:
    """A tamper hook returning ``Late(reply)`` delays the reply: it can be pulled only after the server next
    asks which nodes are online (a slow node, whose answer comes after the round gave up on it)."""

    def __init__(self, reply: Message) -> None:
        self.reply = reply


class FakeGrid(Grid):
    DIE = object()  # a tamper hook returning this kills the node: no reply, now or later

    def __init__(self, client_app, node_configs: list[dict], tamper=None) -> None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        self.client_app = client_app
        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i, node_config=cfg, state=RecordDict(), run_config={})
                         for i, cfg in enumerate(node_configs)}
        self.tamper = tamper  # (node_id, message, reply) -> reply
        self.dead: set[int] = set()
        self.offline: set[int] = set()  # nodes Flower no longer lists (missed heartbeats)
        self.unavailable_errors = False  # answer a dead node's messages as the SuperLink does: NODE_UNAVAILABLE
        self.sent: list[Message] = []
        self.received: list[Message] = []
        self._replies: dict[str, Message] = {}
        self._late: dict[str, Message] = {}

    # the abstract interface
    def set_run(self, run) -> None:
        pass

    @property
    def run(self):
        return None

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        self._replies.update(self._late)
        self._late.clear()
        return [n for n in self.contexts if n not in self.offline]

    def restart(self, node: int, new_id: int | None = None) -> None:
        """The SuperNode ``node`` restarts with an empty Context (its in-memory client state is gone), under its
        old id (node authentication) or ``new_id``, with the same node config."""
        config = self.contexts.pop(node).node_config
        nid = node if new_id is None else new_id
        self.contexts[nid] = Context(run_id=1, node_id=nid, node_config=config, state=RecordDict(), run_config={})
        self.dead -= {node, nid}
        self.offline -= {node, nid}

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            ids.append(msg.metadata.message_id)
            if node in self.dead:
                if self.unavailable_errors:
                    self._replies[msg.metadata.message_id] = Message(
                        Error(code=5, reason="node unavailable"), reply_to=msg)
                continue
            try:
                reply = self.client_app(msg, self.contexts[node])
            except Exception as exc:  # noqa: BLE001 - as Flower does: the error travels back
                reply = Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            if self.tamper is not None:
                reply = self.tamper(node, msg, reply)
            if reply is FakeGrid.DIE:
                self.dead.add(node)
                continue
            if isinstance(reply, Late):
                self._late[msg.metadata.message_id] = reply.reply
                continue
            if reply is not None:
                self.received.append(reply)
                self._replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids):
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))
