"""CLI subcommands, one module each.

Every module here defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
They are discovered by :mod:`flowlift.commands.cli`; heavy imports (torch, diffusers) belong inside ``run``
so that ``flowlift --help`` stays fast.
"""
