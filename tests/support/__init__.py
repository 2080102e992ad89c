"""What the tests share: fixtures-in-code (in-process networks, chains, scripted peers, data).

Test modules import from here and never from each other. ``tests/`` is on ``sys.path`` under pytest's
default (prepend) import mode, so ``from support.audit import ...`` works from any test module."""
