"""fednorm: federated learning under feature shift (multi-domain FL).

Layers, each importing only the ones before it: ``data`` -> ``models`` -> ``methods`` ->
``engines`` -> ``runs`` -> ``cli``.
"""

__version__ = "0.1.0"
