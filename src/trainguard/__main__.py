"""``python -m trainguard`` is the ``trainguard`` command."""

from trainguard.cli.main import main

main()
