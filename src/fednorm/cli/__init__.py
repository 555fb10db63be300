"""The ``fednorm`` command line (:mod:`fednorm.cli.main`) and its console-script entry point."""

from __future__ import annotations

import sys


def _load_app():
    from .main import app

    return app


def entry_point() -> None:
    """The ``fednorm`` console script. Importing the app loads torch (seconds): a Ctrl-C in that time ends with one
    line and exit code 130, as a Ctrl-C during a command does, not with an import traceback. (Not named ``main``:
    importing the submodule fednorm.cli.main would replace a package attribute of that name.)"""
    try:
        app = _load_app()
    except KeyboardInterrupt:
        sys.stderr.write("stopped while starting; nothing was run\n")
        raise SystemExit(130) from None
    app()
