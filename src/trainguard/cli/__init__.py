"""The ``trainguard`` command line: thin commands over the library."""
