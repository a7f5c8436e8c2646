"""The ``zoomkv`` subcommands that do not live with a subsystem (``zoomkv.cli`` lists every subcommand).

Each module is one subcommand: ``add_arguments(parser)`` and ``run(args) -> int``, its docstring the
command's ``--help`` text. Nothing below the command line imports these modules.
"""
