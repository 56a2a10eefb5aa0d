"""The ``kvcore`` command's subcommands, one module each (``kvcore bench`` lives in :mod:`kvcore.bench.cli`),
and :mod:`kvcore.commands.errors`: exit codes and how an error is shown."""
