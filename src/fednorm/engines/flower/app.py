"""The fednorm Flower app: a ServerApp and a ClientApp on Flower's Message API.

``server_app`` and ``client_app`` are the components a Flower app folder names
(``fednorm flower app`` writes one); ``make_server_app`` / ``make_client_app`` build the same apps with
their settings bound in, for the simulation runtime (``fednorm flower sim``).
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from .node import NodeClients
from .server import ServerSettings, run_experiment


def make_server_app(settings: ServerSettings | None = None, progress=None) -> ServerApp:
    """The ServerApp; without ``settings`` it reads them from the run config (``flwr run``)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_experiment(grid, settings or ServerSettings.from_run_config(context.run_config), progress)

    return app


def make_client_app(data_dir: str | None = None, state_dir: str | None = None) -> ClientApp:
    """The ClientApp; ``data_dir`` is the data folder of nodes whose node config names none, ``state_dir`` the
    folder of their clients' state on disk (the simulation's; deployment nodes name theirs: ``state-dir``)."""
    app = ClientApp()
    node = NodeClients(data_dir, state_dir)

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return node.query(message, context)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return node.train(message, context)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return node.evaluate(message, context)

    return app


server_app = make_server_app()
client_app = make_client_app()
