"""The application shell: the ``kvship`` console script and its process kinds.

``kvship.app.cli`` dispatches the subcommands (``serve``, ``local``, and the
router's and operator's own ``cli`` modules); ``kvship.app.serve`` runs one
worker, picking its scheduler with ``kvship.app.roles``; ``kvship.app.local``
runs a whole PD deployment as child processes.

Layering: the app may import every package; nothing under ``kvship.engine``,
``kvship.router`` or ``kvship.operator`` imports the app
(tests/test_layering.py).
"""
