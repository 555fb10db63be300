"""fednorm on Flower (``pip install 'fednorm[flower]'``): the same methods across machines.

- :mod:`.app`: the ServerApp and ClientApp (Flower's Message API);
- :mod:`.server`: the server side (roster of nodes, :class:`~.server.FlowerEngine`, bad-reply policy);
- :mod:`.node`: the client side on a SuperNode (which clients it holds, training and evaluation);
- :mod:`.messages`: what messages carry and what a node keeps in ``Context.state``;
- :mod:`.runtime`: the simulation runtime, app folders for ``flwr run``, a localhost deployment.

docs/flower.md walks through a deployment step by step.
"""
