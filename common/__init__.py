"""Small pieces shared by every layer (engine, roles, router, operator, app shell).

Nothing here imports torch or any other kvship package: ``kvship.router`` and
``kvship.operator`` import it without pulling the engine's dependencies.
"""
